"""Router placement at fleet scale: `make bench-scale` (`--quick`: a CI-sized run).

    python -m bench.scale [--quick] [--workers 4,16,64,256] [--blocks 100000,1000000,10000000]
                          [--rates 100,1000] [--seconds 10] [--max-requests 3000]

Real nats-server (JetStream; monitoring port for message counts), real redis-server, the
real router (1 replica; 3 for the last point) exporting its spans to an in-process OTLP
receiver, and a simulated fleet of W workers speaking the real protocol (bench/scale/fleet.py):
registry heartbeats with static loads, prefix-index writes, admits answered, prefill jobs
pulled and acked, KV never moved. Prompts and caches come from the Mooncake conversation
trace (bench/scale/plan.py); placements are asked as the gateway asks them, open loop
(bench/scale/drive.py).

1. Per W: the plan (which trace blocks each worker caches, its load).
2. Per (W, B): a fresh NATS, Redis and router; the fleet starts, registers and indexes its
   trace blocks, then fills the index to B blocks (Redis bytes per block: what Redis holds
   after the fill less before the fleet started, ÷ B; clients' buffers not counted).
3. Per rate: an idle window (every counter's background rate: heartbeats, lease refreshes,
   polling), then `--seconds` of Poisson arrivals (at most `--max-requests`), then the
   router's spans; the decisions are checked against today's policy (bench/scale/check.py).
4. At the largest (W, B) two more router replicas join for a run at the largest rate.
5. A peer, vLLM's Rust router, in front of as many mock OpenAI workers, fed the same prompts at
   the same rates (bench/scale/peer.py: `cache_aware` and `round_robin`, at the fewest and the
   most workers): the latency it adds and its CPU per request, beside ours.
Before them, on the router's cores, what this machine charges a process that waited (bench/warmth.py:
a router at 100 req/s waits ~10 ms before each placement), reported beside the router's CPU.
Writes bench/results/scale.json (machine, mode, config, runs, summary), scale.png and the
"Scale" section of docs/RESULTS.md (bench/scale/readme.py).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import uvloop

from bench import warmth
from bench.machine import cpu_model
from bench.scale import peer, readme, report
from bench.scale.check import Replay, check, holders
from bench.scale.drive import admit_split, drive, placements, route_spans
from bench.scale.fleet import LATE_EVERY_S
from bench.scale.meters import usage
from bench.scale.pin import pin, under_test
from bench.scale.plan import TRACE, TRACE_BLOCKS, FleetWorker, Trace, filler_counts, make_plan, read_trace
from bench.scale.report import percentiles
from bench.scale.stage import Stage, stage, store_name
from pdserve.services.router.recent import REGISTRY_READ_S
from pdserve.services.router.registry import RegistryCopy
from pdserve.shared.config import Common, RouterSettings
from pdserve.shared.state import State
from pdserve.shared.tools.otlp_sink import OtlpReceiver

RESULTS = Path(__file__).parents[1] / "results"
FULL = {"workers": [4, 16, 64, 256], "blocks": [100_000, 1_000_000, 10_000_000], "rates": [100, 1000],
        "seconds": 10.0, "max_requests": 3000}
QUICK = {"workers": [4, 256], "blocks": [100_000], "rates": [100], "seconds": 4.0, "max_requests": 5000}
IDLE_S = 3.5        # longer than the router's booking horizons (pdserve/services/router/recent.py): none crosses runs
REPLICAS = 3
CORES = os.cpu_count() or 1


async def fill(st: Stage, blocks: int) -> dict:
    """The fleet's index filled to `blocks`: how long it took, what Redis holds more for it."""
    t = time.monotonic()
    await st.fleet.fill(blocks)
    used = (await st.meters.read()).redis_memory - st.memory_before
    return {"fill_s": round(time.monotonic() - t, 1), "redis_memory_delta": used,
            "redis_bytes_per_block": round(used / blocks, 1)}


async def measure(st: Stage, trace: Trace, plan: list[FleetWorker], blocks: int, rate: float, seconds: float,
                  receiver: OtlpReceiver, replicas: int) -> dict:
    """One run: an idle window, the arrivals, then until the routers have worked off what they
    hold (the counters cover all the work the run caused); the decisions checked."""
    await st.synced(len(plan))
    await st.quiet()
    r0 = await st.meters.read()
    await asyncio.sleep(IDLE_S)
    r1 = await st.meters.read()
    receiver.spans.clear()
    await st.fleet.admits()   # forget those before this run
    for server in st.servers:
        await server.slowlog_reset()
    gc.collect()
    gc.freeze()   # (the driver's arrivals on time: a full collection of this process's trace and plan took ~0.2 s)
    sent, start = await drive(st.bus, trace.probes, rate, seconds, tag=f"w{len(plan)}-b{blocks}-r{rate}-x{replicas}")
    await st.quiet()
    r2 = await st.meters.read()
    spans = await route_spans(receiver, {s.request_id for s in sent})
    sizes = {w.worker_id: len(w.cached) + f for w, f in zip(plan, filler_counts(blocks, plan))}
    replay = Replay(await st.state.registry.workers(), sizes, holders(plan), RouterSettings())
    admits, rewrites, late_ms = await st.fleet.admits()
    decided = placements(sent, spans, admits)
    row = {"workers": len(plan), "blocks": blocks, "rate": rate, "replicas": replicas, "seconds": seconds,
           "store": st.store,
           "index_rewrites_so_far": rewrites,
           **gateway_view(sent, start, seconds), **router_view(spans),
           **counters(usage(r0, r1), usage(r1, r2), max(len(decided), 1))}
    row["admit_ms"] = admit_split(spans, admits)
    # its loop busy: an admit's wait there (bench/scale/fleet.py)
    row["fleet_late_ms"] = {**percentiles(late_ms), "every_ms": 1e3 * LATE_EVERY_S}
    row["redis_slow"] = report.slow_commands([e for server in st.servers for e in await server.slowlog_get(4096)])
    row["registry_read_ms"] = await registry_reads(st.state)
    row["kept_up"] = report.kept_up(row)
    row["decisions"] = check(decided, replay, rebuilt=row["kept_up"])
    row["limited_by"] = report.bottleneck(row, CORES)
    receiver.spans.clear()
    return row


async def registry_reads(state: State, rounds: int = 20) -> dict:
    """A router's registry read, side by side while the fleet heartbeats: the whole registry
    (`state.registry.workers`, as routers read it before) and the changes since the last read
    (pdserve/services/router/registry.py), REGISTRY_READ_S apart; median ms of each."""
    whole, changes, registry = [], [], RegistryCopy()
    await registry.read(state)
    for _ in range(rounds):
        await asyncio.sleep(REGISTRY_READ_S)
        t = time.perf_counter()
        await state.registry.workers()
        whole.append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        await registry.read(state)
        registry.workers()
        changes.append(1e3 * (time.perf_counter() - t))
    return {"whole": round(float(np.median(whole)), 3), "changes": round(float(np.median(changes)), 3)}


def gateway_view(sent: list, start: float, seconds: float) -> dict:
    """What the gateway saw: answers, and the time each took."""
    answered = [s for s in sent if s.reply is not None and s.reply.ok]
    refused = Counter(re.sub(r"\d+", "N", s.reply.reason)[:80] for s in sent if s.reply is not None and not s.reply.ok)
    end = max((s.done_at for s in answered), default=start)
    return {"offered": len(sent), "offered_rate": round(len(sent) / seconds, 1), "placed": len(answered),
            "refused": sum(refused.values()), "refused_because": dict(refused.most_common(5)),
            "timed_out": sum(s.reply is None for s in sent),
            "achieved_rate": round(len(answered) / max(end - start, seconds), 1),
            "placement_ms": percentiles([1e3 * s.latency_s for s in answered]),
            "driver_lag_ms": percentiles([1e3 * s.lag_s for s in sent])}


def failed(spans: dict) -> int:
    """Routes that raised (Redis or NATS trouble): their bookings are not in the spans."""
    return sum(str(s.attributes.get("reason", "")).startswith("routing failed") for s in spans.values())


def router_view(spans: dict) -> dict:
    """What the routers' spans say: every decision, including those the gateway gave up on,
    and why any request was not placed."""
    ok = [s for s in spans.values() if s.attributes.get("ok")]
    why = Counter(re.sub(r"\d+", "N", str(s.attributes.get("reason", "")))[:80] for s in spans.values()
                  if not s.attributes.get("ok"))
    return {"spans_received": len(spans), "router_placed": len(ok), "router_failed": failed(spans),
            "not_placed_because": dict(why.most_common(5)), "decision_ms": percentiles([s.duration_ms for s in ok]),
            # less the wait for the (simulated) decode workers' admit answers: the router's own part
            "decision_own_ms": percentiles([s.duration_ms - s.attributes.get("admit_wait_ms", 0.0) for s in ok]),
            # of which before the first admit (the inputs read, the first choice, the claim: Redis's round
            # trips and, with the index in memory, its lookup) and the claim renewals
            "decision_redis_ms": percentiles([s.attributes.get("begin_ms", 0.0) + s.attributes.get("renew_ms", 0.0)
                                              for s in ok])}


def counters(idle, load, placed: int) -> dict:
    """CPU and messages over the run, per placement the routers made."""
    return {"cpu_pct": load.cpu_pct(CORES), "idle_cpu_pct": idle.cpu_pct(CORES),
            "router_cpu_ms_per_placement": per_placement(load, idle, "router", placed),
            "redis_cpu_ms_per_placement": per_placement(load, idle, "redis", placed),
            "nats_per_request": nats_per_request(load, idle, placed)}


def per_placement(load, idle, name: str, placed: int) -> dict:
    """CPU ms per placement of the processes named `name*`, as measured and less the idle rate."""
    keys = [k for k in load.cpu_s if k.startswith(name)]
    raw = sum(load.cpu_s[k] for k in keys)
    net = sum(load.net(idle, k) for k in keys)
    return {"raw": round(1e3 * raw / placed, 3), "net": round(1e3 * net / placed, 3)}


def nats_per_request(load, idle, placed: int) -> dict:
    """Messages into / out of nats-server per placement: all, less the idle rate, and the routers' own."""
    return {"in": round(load.nats.get("in", 0) / placed, 2), "out": round(load.nats.get("out", 0) / placed, 2),
            "net_in": round(load.net(idle, "in", "nats") / placed, 2),
            "net_out": round(load.net(idle, "out", "nats") / placed, 2),
            "router_in_out": round((load.nats.get("router.in", 0) + load.nats.get("router.out", 0)) / placed, 2),
            "idle_in_per_s": round(idle.nats.get("in", 0) / idle.wall_s, 1)}


async def for_workers(trace: Trace, workers: int, args, receiver: OtlpReceiver, log_dir: Path) -> list[dict]:
    """Every run with W workers: per B a fresh stage, filled, then each rate (and the replicas' run)."""
    plan = make_plan(trace, workers, args.trace_blocks)
    runs = []
    for blocks, cluster in ((b, c) for b in args.blocks for c in args.stores):
        async with stage(plan, receiver, log_dir / f"w{workers}-b{blocks}-{store_name(cluster)}", cluster) as st:
            filled = await fill(st, blocks)
            print(f"W={workers} B={blocks:,} on {st.store}: filled in {filled['fill_s']} s, "
                  f"{filled['redis_bytes_per_block']} Redis bytes per block", flush=True)
            rates = [(r, 1) for r in args.rates]
            if (workers, blocks, cluster) == (max(args.workers), max(args.blocks), args.stores[0]):
                rates.append((max(args.rates), REPLICAS))
            for rate, replicas in rates:
                await st.routers(replicas, len(plan))
                seconds = min(args.seconds, args.max_requests / rate)
                pinned = pin(st.pids()) if args.pin else {}
                row = {**await measure(st, trace, plan, blocks, rate, seconds, receiver, replicas), **filled,
                       "cores": pinned}
                runs.append(row)
                print(line(row), flush=True)
    return runs


def line(r: dict) -> str:
    d, g, c = r["decision_ms"], r["placement_ms"], r["decisions"]
    return (f"  W={r['workers']} B={r['blocks']:,} {r['store']} {r['rate']:g} req/s x{r['replicas']}: decision p50/p99 "
            f"{d['p50']}/{d['p99']} ms, gateway {g['p50']}/{g['p99']} ms, {r['achieved_rate']} req/s placed, "
            f"router {r['cpu_pct'].get('router', 0)}% "
            f"redis {round(sum(v for k, v in r['cpu_pct'].items() if k.startswith('redis')), 1)}% "
            f"machine {r['cpu_pct']['machine']}% (other {r['cpu_pct']['other']}%), "
            f"NATS {r['nats_per_request']['net_in']} msgs/req, hit rate {c['hit_rate_router']:.3f} "
            f"(policy {c['hit_rate_policy']:.3f}, same prefill {c['same_prefill']:.3f})")


def machine() -> dict:
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
            "python": platform.python_version()}


async def main_async(args) -> dict:
    t0 = time.monotonic()
    cold = warmth.measure(under_test() if args.pin else None)   # on the router's cores, before anything runs
    trace = read_trace(args.trace, args.history)
    receiver = OtlpReceiver()
    log_dir = Path(args.log_dir)
    runs = []
    try:
        for workers in args.workers:
            runs += await for_workers(trace, workers, args, receiver, log_dir)
    finally:
        receiver.close()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "quick"}
    config.update(trace_name=args.trace.name, probes=len(trace.probes), block_tokens=16,
                  prefix_index=Common().prefix_index,
                  scale="one 16-token block per 512-token trace block", idle_s=IDLE_S)
    return {"machine": {**machine(), "warmth": cold}, "mode": "quick" if args.quick else "full", "config": config,
            "duration_s": round(time.monotonic() - t0, 1), "runs": runs,
            "summary": {**report.summary([r for r in runs if r["store"] == store_name(args.stores[0])], CORES, cold),
                        **report.stores(runs)}}


def parse() -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"CI-sized: {QUICK}")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave the routers and the rest on the same cores (bench/scale/pin.py)")
    ap.add_argument("--workers", type=ints)
    ap.add_argument("--blocks", type=ints)
    ap.add_argument("--rates", type=ints)
    ap.add_argument("--seconds", type=float, help="of arrivals per run")
    ap.add_argument("--max-requests", type=int, help="per run: a higher rate runs for less time")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--history", type=float, default=0.5, help="fraction of the trace replayed into the caches")
    ap.add_argument("--trace-blocks", type=int, default=TRACE_BLOCKS, help="trace blocks per pool at most")
    ap.add_argument("--log-dir", default=f"/tmp/pdserve-scale-{os.getpid()}")
    ap.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    ap.add_argument("--no-peer", dest="peer", action="store_false", help="leave vllm-router out (step 5)")
    ap.add_argument("--stores", type=ints, default=[0], help="each (W, B) on each store: 0 one redis-server, N a "
                    "Redis Cluster of N primaries (redis+cluster://); the summary's targets are the first's")
    args = ap.parse_args()
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main() -> None:
    args = parse()
    print(f"bench-scale ({'quick' if args.quick else 'full'}): W={args.workers} B={args.blocks} rates={args.rates} "
          f"{args.seconds:g} s each; logs in {args.log_dir}", flush=True)
    result = uvloop.run(main_async(args))
    if args.peer:
        print("vllm-router in front of mock workers, the same prompts and rates:", flush=True)
        t0 = time.monotonic()
        result["peer"] = peer.measure(sorted({min(args.workers), max(args.workers)}), args.rates,
                                      list(peer.POLICIES), args.seconds, Path(args.log_dir))
        result["summary"].update(peer.summary(result["peer"]))
        result["duration_s"] = round(result["duration_s"] + time.monotonic() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    report.plot(result["runs"], args.out.with_suffix(".png"))
    if args.out == RESULTS / "scale.json":  # the committed results: the README's section follows them
        readme.update(result)
    elif args.out == RESULTS / "scale_stores.json":
        readme.update_stores(result)
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {args.out} and {args.out.with_suffix('.png').name} in {result['duration_s']} s")


if __name__ == "__main__":
    main()
