"""Faults under load, on the live stack: `make chaos`.

    python -m bench.chaos [--requests 100] [--scenarios kill-prefill,kill-decode,restart-nats,...]

One stack (2 prefill + 2 decode workers). First every request runs once with no fault: that
is each request's reference output. Then, per scenario, all requests run again at once
(greedy, streamed, token ids returned) and the fault strikes while they are in flight:

  kill-prefill   kill -9 of the prefill worker with the most queued prompt tokens
  kill-decode    kill -9 of the decode worker with the most running sequences
  kill-prefill-pool  kill -9 of every prefill worker: the last resort, prompts (the queued
                 jobs' and new ones) prefilled on the decode workers, between their streams
  restart-nats   kill -9 of nats-server, started again (JetStream store kept)
  restart-redis  kill -9 of redis-server, started again empty (no persistence)

and on a second stack with the bus and the store as a fleet runs them (pdserve/local/ha.py:
a 3-node NATS cluster, the prefill job stream on all 3; a Redis primary and a replica under
3 Sentinels), the same workers and load:

  kill-nats-node      kill -9 of the NATS node the gateway is connected to (every client on it
                      moves to another node; the node is started again after the load)
  kill-redis-primary  kill -9 of the Redis primary: the Sentinels promote the replica (the old
                      primary is started again after the load and becomes its replica)

and on a third with every process on a host of its own (network namespaces on one switch,
bench/netns.py; workers share no memory: UCX over TCP on their host's link), where there is
root and `ip netns` (otherwise reported skipped):

  cut-decode-host     the link of the host of the decode worker with the most running
                      sequences goes down for CUT_S (longer than its lease), then up again:
                      its streams move, and back on the network it must end what it held

and on a fourth, made for pressure (the fake model at full pace, a small NATS buffer):

  nats-outage         nats-server killed while every stream decodes, started again OUTAGE_S
                      later: the workers step on, chunks replayed (bench/chaos/outage.py)

A request is *lost* if it does not complete (an error status or an error in the stream),
*mismatched* if its tokens differ from its reference in any way (a repeated or missing token
included). Afterwards every worker still up must return to an empty KV pool (*leaked
blocks* otherwise). *Recovery* (`recovery_s`) is, over the streams that had begun before the
fault, the longest wait from the fault to their next token; `extra_s` is how much longer the
whole load took than without the fault (it includes requests that were queued or in prefill
on the worker hit). From each request's events and its run without faults
(bench/chaos/measure.py): the streams moved (failed over, or their prefill job requeued off a
lost prefill worker) — the wait for their next token (`moved_recovery_s`) and how much later
they ended (`moved_delay_s`); the prompts recomputed on a decode worker (`local_recomputes`);
and the streams not moved — their inter-token p99 during the recovery over before the fault
and over the same window without faults (`itl_p99_during_over_before`, `_over_reference`).
The killed process is started again before the next scenario. One line per scenario:

    chaos: requests=N lost=0 mismatched=0 leaked_blocks=0 scenario=... recovery_s=... extra_s=...
           ... moved_recovery_s=... moved_delay_s=... local_recomputes=... itl_p99_during_over_before=...

`--busy` (`make chaos-busy`) runs it all beside a busy neighbour: a process spinning on a
core at normal priority, started before the stack and stopped after it; slow must cost time,
never requests. Writes bench/results/chaos-busy.json instead.

A fault must cost only the process it hit: any other process found dead afterwards is
reported (`collateral`, with its exit status) and started again; a worker not back in the
registry afterwards is reported (`missing_after`), not counted as an empty pool. Exit status 1
if any scenario lost, mismatched, leaked, took another process with it, left a worker missing,
or (kill-redis-primary) saw no replica promoted; writes bench/results/chaos.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

from bench import netns
from bench.chaos import outage, readme
from bench.chaos.fleet import client_of, moves, pools, request_events, settle
from bench.chaos.load import Outcome, prompts, run_all
from bench.chaos.measure import Stream, cost
from pdserve.local import ha
from pdserve.local.config import Host
from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.config import model_id
from pdserve.shared.progress import progress
from pdserve.shared.subjects import PREFILL_STREAM

RESULTS = Path(__file__).parents[1] / "results" / "chaos.json"
SCENARIOS = ("kill-prefill", "kill-decode", "kill-prefill-pool", "restart-nats", "restart-redis")
HA_SCENARIOS = ("kill-nats-node", "kill-redis-primary")   # on the HA stack
HOST_SCENARIOS = ("cut-decode-host",)                      # with a host per process
ALL = SCENARIOS + HA_SCENARIOS + HOST_SCENARIOS + outage.OUTAGE_SCENARIOS
CUT_S = 5.0   # how long a host is cut off: over three leases (ENV's heartbeat 0.5 s)
WORKERS_UP = {"prefill-0", "prefill-1", "decode-0", "decode-1"}
# Every prompt goes through the prefill pool (the cheapest placement would keep some on their
# decode worker and leave the pool's faults fewer prompts, or none, to strike).
ENV = {"PD_HEARTBEAT_S": "0.5", "PD_FAILOVER_CHECK_S": "0.5", "PD_KV_TIMEOUT_S": "30",
       "PD_PLACEMENT": "remote"}


def strike(stack: Stack, scenario: str, links: dict[str, netns.Link]) -> list[str]:
    """The fault; returns the names of the processes hit."""
    now = pools(stack)
    if scenario == "cut-decode-host":
        victim = max((w for w in now.values() if w["role"] == "decode"), key=lambda w: w["running"])["worker_id"]
        netns.set_link(links[victim], up=False)
        return [victim]
    if scenario == "kill-prefill":
        victims = [max((w for w in now.values() if w["role"] == "prefill"),
                       key=lambda w: w["queued_tokens"])["worker_id"]]
    elif scenario == "kill-decode":
        victims = [max((w for w in now.values() if w["role"] == "decode"),
                       key=lambda w: w["running"] + w["waiting"])["worker_id"]]
    elif scenario == "kill-prefill-pool":
        victims = sorted(w for w in WORKERS_UP if w.startswith("prefill"))
    elif scenario == "kill-nats-node":
        victims = [gateway_node(stack)]
    elif scenario == "kill-redis-primary":
        victims = [redis_primary(stack)]
    elif scenario in outage.OUTAGE_SCENARIOS:   # (started again by outage.through)
        victims = ["nats"]
    else:
        victims = [scenario.removeprefix("restart-")]
    for victim in victims:
        stack.procs[victim].kill()
    for victim in victims:
        stack.procs[victim].wait(10)
        # the single servers come back at once (NATS after the outage); workers and HA servers after the load
        if victim in ("nats", "redis") and not stack.ha_ports and scenario not in outage.OUTAGE_SCENARIOS:
            stack.restart(victim)
    return victims


def gateway_node(stack: Stack) -> str:
    """The NATS node the gateway is connected to (from each node's /connz)."""
    assert stack.ha_ports
    for i, port in enumerate(stack.ha_ports.monitor):
        try:
            conns = httpx.get(f"http://127.0.0.1:{port}/connz?limit=4096", timeout=5).json()["connections"]
        except httpx.HTTPError:
            continue
        if any(c.get("name") == "gateway" for c in conns or []):
            return f"nats-{i}"
    raise RuntimeError("the gateway is connected to no NATS node")


def redis_primary(stack: Stack) -> str:
    """The process the Sentinels name as the primary now."""
    assert stack.ha_ports
    _, port = client_of(stack.redis_url).connection_pool.get_master_address()
    return "redis" if port == stack.ha_ports.redis[0] else "redis-replica"


def rejoin(stack: Stack, server: str, timeout_s: float = 60) -> None:
    """Start a server of the HA stack the fault killed again and wait until it serves its part:
    a NATS node back in the cluster with the prefill stream on it, a Redis node a replica of
    the new primary with its link up (the Sentinels reconfigure it)."""
    assert stack.ha_ports
    stack.restart(server)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, redis.RedisError, KeyError, ValueError):
            if server.startswith("nats"):
                port = stack.ha_ports.monitor[int(server.split("-")[1])]
                streams = httpx.get(f"http://127.0.0.1:{port}/jsz?streams=true", timeout=2).json()
                if any(s["name"] == PREFILL_STREAM for a in streams["account_details"]
                       for s in a.get("stream_detail", [])):
                    return
            else:
                port = stack.ha_ports.redis[0 if server == "redis" else 1]
                info = redis.Redis(port=port, password=stack.secret, socket_timeout=2).info("replication")
                if info["role"] == "slave" and info["master_link_status"] == "up":
                    return
        time.sleep(0.3)
    raise RuntimeError(f"{server} did not rejoin within {timeout_s} s")


async def scenario_run(stack: Stack, scenario: str, requests, reference: list[Outcome], max_tokens: int,
                       reference_s: float, links: dict[str, netns.Link]) -> dict:
    before = await asyncio.to_thread(moves, stack)
    started = asyncio.Event()
    trigger = max(1, len(requests) // (10 if scenario.startswith("kill-prefill") else 3))
    if scenario in outage.OUTAGE_SCENARIOS:   # every stream decoding (none is placed with the bus away)
        trigger = len(requests)
    started_at = time.monotonic()
    load = asyncio.create_task(run_all(stack.url, requests, max_tokens, started, trigger, model_id(stack.cfg.model)))
    await asyncio.wait({asyncio.create_task(started.wait()), load}, return_when=asyncio.FIRST_COMPLETED)
    fault_at = time.monotonic()
    hit = await asyncio.to_thread(strike, stack, scenario, links)
    victims = [] if scenario in HOST_SCENARIOS else hit   # a host cut off: its processes live on
    if scenario in HOST_SCENARIOS:
        await asyncio.sleep(CUT_S)
        netns.set_link(links[hit[0]], up=True)
    figures = await outage.through(stack, reference) if scenario in outage.OUTAGE_SCENARIOS else {}
    outcomes = await load
    took = time.monotonic() - started_at
    after = await asyncio.to_thread(moves, stack)
    moved = {k: int(v - before.get(k, 0)) for k, v in after.items() if v > before.get(k, 0)}
    lost = [i for i, o in enumerate(outcomes) if o.status != 200 or o.error]
    mismatched = [i for i, o in enumerate(outcomes) if i not in lost and o.ids != reference[i].ids]
    fault_s = fault_at - started_at
    waits = [next(t - fault_s for t in o.times if t > fault_s) for o in outcomes
             if o.times and o.times[0] <= fault_s < o.times[-1]]
    events = await asyncio.to_thread(request_events, stack, [o.request_id for o in outcomes])
    paid = cost([Stream(o.times, ref.times, e) for o, ref, e in zip(outcomes, reference, events)], fault_s)
    survivors = WORKERS_UP - set(victims)
    # a fault must cost only the processes it hit: any other that died with them is a failure
    collateral = {n: p.returncode for n, p in stack.procs.items() if n not in victims and p.poll() is not None}
    for name in collateral:   # back, so that the next scenario starts whole
        stack.restart(name)
    promoted = await asyncio.to_thread(redis_primary, stack) if scenario == "kill-redis-primary" else ""
    for server in (v for v in victims if ha.is_server(v) and stack.procs[v].poll() is not None):
        await asyncio.to_thread(rejoin, stack, server)
    taken = await asyncio.to_thread(settle, stack, survivors)
    missing = sorted(w for w, n in taken.items() if n < 0)   # not back in the registry: not counted as empty
    if WORKERS_UP - survivors:   # back for the next scenario
        for victim in sorted(WORKERS_UP - survivors):
            stack.restart(victim)
        await asyncio.to_thread(settle, stack, WORKERS_UP, 120)
    return {"scenario": scenario, "victim": "+".join(hit), "collateral": collateral, "requests": len(requests),
            "lost": len(lost), "missing_after": missing, **({"promoted": promoted} if promoted else {}),
            "mismatched": len(mismatched), "leaked_blocks": sum(max(0, n) for n in taken.values()),
            "recovery_s": round(max(waits, default=0.0), 2), "extra_s": round(took - reference_s, 2),
            "streams_in_flight": len(waits), **paid, "moved": moved,
            "lost_errors": [outcomes[i].error for i in lost][:5],
            "mismatched_ids": mismatched[:10], "blocks_taken_after": taken, **figures}


@contextlib.contextmanager
def neighbour(busy: bool):
    """With `busy`: a process spinning on a core at normal priority for the whole run (a busy
    neighbour on a shared machine), stopped at the end."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


async def main_async(args) -> list[dict]:
    """Each scenario of args.scenarios on its stack: the single-server one, the HA one, then the
    one with a host per process."""
    results = []
    for kind, theirs in (("single", SCENARIOS), ("ha", HA_SCENARIOS), ("hosts", HOST_SCENARIOS),
                         ("outage", outage.OUTAGE_SCENARIOS)):
        scenarios = [s for s in args.scenarios if s in theirs]
        if not scenarios:
            continue
        with contextlib.ExitStack() as made:
            try:
                (hosts, worker_env), links = made.enter_context(placed(kind))
            except netns.NoNetns as e:   # (only where the hosts are made: a fault mid-run is a failure)
                print(f"chaos: skipped {', '.join(scenarios)}: no separate hosts here ({e})", flush=True)
                results += [{"scenario": s, "stack": kind, "skipped": str(e)} for s in scenarios]
                continue
            results += await on_stack(args, scenarios, kind, hosts, worker_env, links)
    return results


@contextlib.contextmanager
def placed(kind: str):
    """Where each process runs: ((StackConfig.hosts, .worker_env), the hosts' links); a host per
    process for "hosts" (NoNetns where that cannot be made), all on this machine's loopback
    otherwise."""
    if kind != "hosts":
        yield ({}, {}), {}
        return
    with netns.bridged(["hub", *sorted(WORKERS_UP)]) as links:
        yield netns.placement(links, {w: w for w in WORKERS_UP}), links


async def on_stack(args, scenarios: list[str], kind: str, hosts: dict[str, Host],
                   worker_env: dict[str, dict[str, str]], links: dict[str, netns.Link]) -> list[dict]:
    shape = {"kv_blocks": args.kv_blocks, **(outage.stack_shape() if kind == "outage" else {})}
    requests, max_tokens = prompts(shape.pop("requests", args.requests)), shape.pop("max_tokens", args.max_tokens)
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    cfg = StackConfig.on_free_ports(prefill=2, decode=2, log_dir=log_dir, ha=kind == "ha", hosts=hosts,
                                    worker_env=worker_env, tls=getattr(args, "tls", False),
                                    **{**shape, "env": {**ENV, **shape.get("env", {})}})
    results = []
    busy = getattr(args, "busy", False)
    with neighbour(busy), Stack(cfg) as stack:
        where = {"single": "", "ha": " on the HA bus and store", "hosts": " each on a host of its own",
                 "outage": f" on the fake model with a NATS buffer of {outage.PENDING_BYTES} bytes"}[kind]
        print(f"stack up: 2 prefill + 2 decode{where}{' beside a busy neighbour' if busy else ''}"
              f"{' on mutual TLS' if cfg.tls else ''}; "
              f"logs in {log_dir}", flush=True)
        t0 = time.monotonic()
        reference = await run_all(stack.url, requests, max_tokens, model=model_id(cfg.model))
        reference_s = time.monotonic() - t0
        bad = [i for i, o in enumerate(reference) if o.status != 200 or o.error or len(o.ids) != max_tokens]
        if bad:
            sys.exit(f"the run without faults failed for {len(bad)} requests: {reference[bad[0]].error}")
        await asyncio.to_thread(settle, stack, WORKERS_UP)
        for scenario in progress(scenarios, f"chaos ({kind})", unit="scenario"):
            r = await scenario_run(stack, scenario, requests, reference, max_tokens, reference_s, links)
            r["stack"] = kind
            results.append(r)
            print(f"chaos: requests={r['requests']} lost={r['lost']} mismatched={r['mismatched']} "
                  f"leaked_blocks={r['leaked_blocks']} scenario={scenario} recovery_s={r['recovery_s']} "
                  f"extra_s={r['extra_s']} (load without faults: {reference_s:.1f} s) "
                  f"streams_in_flight={r['streams_in_flight']} moved={r['moved'] or '{}'} "
                  f"moved_recovery_s={r['moved_recovery_s']} moved_delay_s={r['moved_delay_s']} "
                  f"local_recomputes={r['local_recomputes']} "
                  f"itl_p99_during_over_before={r['itl_p99_during_over_before']} "
                  f"itl_p99_during_over_reference={r['itl_p99_during_over_reference']}", flush=True)
            if scenario in outage.OUTAGE_SCENARIOS:
                print(outage.summary(r), flush=True)
            if r["collateral"] or r["lost"]:
                print(f"  also died (exit status): {r['collateral'] or 'none'}; errors: {r['lost_errors']}", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--scenarios", type=lambda s: s.split(","), default=list(ALL))
    ap.add_argument("--busy", action="store_true", help="beside a process spinning on a core for the whole run; "
                    "writes bench/results/chaos-busy.json")
    ap.add_argument("--tls", action="store_true", help="NATS and Redis on mutual TLS (StackConfig.tls); writes "
                    "bench/results/chaos-tls.json")
    args = ap.parse_args()
    unknown = set(args.scenarios) - set(ALL)
    if unknown:
        sys.exit(f"unknown scenarios: {', '.join(sorted(unknown))}")
    results = asyncio.run(main_async(args))
    out = RESULTS.with_name("chaos-busy.json" if args.busy else "chaos-tls.json" if args.tls else RESULTS.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "scenarios": results}, indent=2))
    readme.write()
    print(f"wrote {out} and the chaos figures of docs/RESULTS.md")
    sys.exit(1 if any(map(failed, results)) else 0)


def failed(r: dict) -> bool:
    """A scenario that lost, mismatched, leaked, took another process with it, left a worker
    missing, (kill-redis-primary) saw no replica promoted, or (nats-outage) no publish refused; a
    skipped one did not fail."""
    return bool(r.get("lost") or r.get("mismatched") or r.get("leaked_blocks") or r.get("collateral")
                or r.get("missing_after") or (r["scenario"] == "kill-redis-primary" and r["promoted"] == r["victim"])
                or (r["scenario"] in outage.OUTAGE_SCENARIOS and not r.get("publish_errors")))
