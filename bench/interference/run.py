"""Does a long prompt freeze everyone else's tokens, and what does disaggregation buy in
goodput? `make bench` (quick, ~15 minutes) / `make bench-full` (~65 minutes).

Three arms on the same cores, one after the other in one run, the same seeded workloads each:

- colocated: one worker does prefill and decode, whole prompts in one pass (PD_PREFILL_CHUNK
  above the longest prompt), all cores;
- chunked: the same worker with vLLM's chunked prefill: each pass holds every running stream's
  decode token and prompt chunks of at most PD_PREFILL_CHUNK=128 tokens each, within
  PD_MAX_BATCHED_TOKENS=256 (a long prompt delays running streams by one chunk at a time, in
  their own step);
- disaggregated: 1 prefill + 1 decode worker, 1 torch thread each, the prefill worker pinned to
  its core, the decode worker stepping on the prefill worker's thread too between that worker's
  passes (PD_CORE_BOARD, pdserve/shared/cores.py; "disaggregated-pinned": each on its own core,
  nothing lent, victims only), the router's default placement (PD_PLACEMENT=cheapest: a short prompt that would queue
  behind a long one is prefilled on the decode worker, beside its streams).

Every worker runs mixed passes (the engine's default), so the colocated arm differs from the
chunked one only in its chunk and budget.

And the peer a user who serves on CPUs would pick instead: llama.cpp's `llama-server` on the
same GGUF and all cores, 8 slots (bench/interference/peer.py), "llama-server"; the stack's figures
divided by its in `summary` (`*_over_llama_server`).

And the victims and aggressors once more on the disaggregated arm with PD_PLACEMENT=remote
(every prompt to the prefill pool), "disaggregated-remote".

Per arm, on one stack:
1. Victims and aggressors: 32-token prompts with 128 output tokens (Poisson --victim-rate)
   while 1024-token prompts with 4 output tokens arrive (Poisson --aggressor-rate). The
   victims' TTFT / ITL / TPOT, the longest token gap, a token timeline; before it, the same
   victims alone (no aggressor), whose TTFT p99 the victims' is divided by.
2. Goodput: the Azure conversation trace (bench/data/azure_conv_2023.csv, lengths
   divided by --scale) replayed with Poisson arrivals at each of --rates for --replay-s
   seconds (its first rate x replay-s rows); SLO attainment per rate; goodput = the highest
   rate with >= 90% of requests meeting both SLOs (pdserve.planner.metrics.rate_at_attainment).
   The SLOs come from this machine's own costs, measured before the arms (TTFT <= 4 x the p90
   prompt's prefill alone, TPOT <= 2 x a decode step at batch 8; `slo_for`), or are absolute
   (--replay-slo-ttft / --replay-slo-tpot); the seconds used are printed and written.

Writes bench/results/interference.json (`summary` holds the ratios), then the plots and the
results section of docs/RESULTS.md (bench/interference/report.py).

    python -m bench.interference [--full] [--duration S] [--rates 1,2,4] [--replay-s S]
                                 [--model smollm2|gemma3-270m] [--arms disaggregated,llama-server]

With --model other than smollm2 the JSON is bench/results/interference-<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np

from bench.interference import peer, report
from bench.interference.stacks import arms, pinned_arm, remote_arm
from bench.load.client import run
from bench.machine import cpu_model
from bench.planning.profile import reference
from pdserve.local.stack import Stack, StackConfig
from pdserve.planner import workloads
from pdserve.planner.metrics import Timing, percentiles, rate_at_attainment, summarize
from pdserve.planner.slo import Slo, from_reference
from pdserve.shared.config import model_id
from pdserve.shared.engine.sources import NAMED

AZURE = Path(__file__).parents[1] / "data" / "azure_conv_2023.csv"
RESULTS = Path(__file__).parents[1] / "results"
QUICK = {"duration": 60.0, "rates": [0.5, 1.0, 2.0, 4.0], "replay_s": 20.0}
FULL = {"duration": 180.0, "rates": [0.5, 1.0, 2.0, 3.0, 4.0, 6.0], "replay_s": 60.0}


def timeline(reqs: list[workloads.Request], timings: list[Timing]) -> dict:
    """Token arrival times from the run's start: each victim's chunks, each aggressor's
    arrival and first token (the plot of stalls)."""
    start = min(t.sent for t in timings)
    rel = lambda x: round(x - start, 4)  # noqa: E731
    return {"victims": [[rel(c) for c, _ in t.chunks] for r, t in zip(reqs, timings) if r.kind == "victim"],
            "aggressors": [[rel(t.sent), rel(t.chunks[0][0]) if t.chunks else None]
                           for r, t in zip(reqs, timings) if r.kind == "aggressor"]}


async def interference_phase(url: str, reqs: list[workloads.Request], args) -> dict:
    timings, duration = await run(url, args.served, reqs)
    victims = [t for r, t in zip(reqs, timings) if r.kind == "victim"]
    aggressors = [t for r, t in zip(reqs, timings) if r.kind == "aggressor"]
    return {"victims": summarize(victims, duration, args.slo_ttft, args.slo_tpot),
            "aggressors": summarize(aggressors, duration, args.slo_ttft * 10, 10.0),
            "victim_itls_s": [round(g, 5) for t in victims for g in t.itls],
            "victim_ttfts_s": ttfts(victims),
            "timeline": timeline(reqs, timings)}


async def alone_phase(url: str, reqs: list[workloads.Request], args) -> dict:
    """The same victims at the same times with no aggressor: what their first token costs
    on this arm by itself."""
    victims = [r for r in reqs if r.kind == "victim"]
    timings, duration = await run(url, args.served, victims)
    return {"victims": summarize(timings, duration, args.slo_ttft, args.slo_tpot),
            "victim_ttfts_s": ttfts(timings)}


async def goodput_phase(url: str, trace: list[workloads.Request], args) -> dict:
    points = []
    for rate in args.rates:
        reqs = workloads.retimed(trace[:max(8, round(rate * args.replay_s))], rate, seed=args.seed)
        timings, duration = await run(url, args.served, reqs)
        s = summarize(timings, duration, args.replay_slo_ttft, args.replay_slo_tpot)
        points.append({"rate": rate, "requests": len(reqs), "slo_attainment": s["slo_attainment"],
                       "goodput": s["goodput"],
                       "completed": s["completed"], "ttft_p90_s": s["ttft_s"]["p90"], "tpot_p90_s": s["tpot_s"]["p90"]})
        print(f"    replay at {rate:4.2f}/s: attainment {s['slo_attainment']:.2f}, "
              f"TTFT p90 {s['ttft_s']['p90']:.2f} s, TPOT p90 {s['tpot_s']['p90'] * 1e3:.0f} ms", flush=True)
    return {"points": points,
            "goodput_rate": rate_at_attainment([(p["rate"], p["slo_attainment"]) for p in points], 0.9)}


REMOTE = "disaggregated-remote"
PINNED = "disaggregated-pinned"
PEER = "llama-server"
ALL_ARMS = ("colocated", "chunked", "disaggregated", REMOTE, PINNED, PEER)


@contextlib.contextmanager
def stack_url(cfg: StackConfig) -> Iterator[str]:
    with Stack(cfg) as stack:
        yield stack.url


def one_arm(name: str, serving: StackConfig | AbstractContextManager[str], reqs, trace, args,
            replay: bool = True) -> dict:
    """One arm's phases on a stack (its config) or any server (a block that serves at its URL)."""
    start = time.monotonic()
    if isinstance(serving, StackConfig):
        args.served = getattr(args, "served", None) or model_id(serving.model)
        serving = stack_url(serving)
    with serving as url:
        asyncio.run(run(url, args.served, workloads.shared_prefix(2, 1, 32, 8, 4)))  # warm-up
        alone = asyncio.run(alone_phase(url, reqs, args))
        out = asyncio.run(interference_phase(url, reqs, args))
        out["alone"] = alone
        v, a = out["victims"], alone["victims"]
        print(f"{name:14} victims {v['completed']}/{v['requests']}: ITL p50 {v['itl_s']['p50'] * 1e3:6.1f} ms "
              f"p99 {v['itl_s']['p99'] * 1e3:7.1f} ms, max gap {v['max_gap_s']:5.2f} s, TTFT p50 "
              f"{v['ttft_s']['p50']:5.2f} s p99 {v['ttft_s']['p99']:5.2f} s (alone {a['ttft_s']['p99']:5.2f} s), "
              f"TPOT p50 {v['tpot_s']['p50'] * 1e3:5.1f} ms", flush=True)
        if not replay:
            out["wall_s"] = round(time.monotonic() - start, 1)
            return out
        out["replay"] = asyncio.run(goodput_phase(url, trace, args))
        print(f"{name:14} goodput at 90% SLO attainment: {out['replay']['goodput_rate']:.2f} req/s", flush=True)
    out["wall_s"] = round(time.monotonic() - start, 1)
    return out


def summary_of(results: dict) -> dict:
    """The ratios between the arms that ran (a ratio with an arm that did not run is None)."""
    div = lambda a, b: round(a / b, 3) if a is not None and b else None  # noqa: E731
    v = {a: r["victims"] for a, r in results.items()}
    get = lambda arm, f: f(v[arm]) if arm in v else None  # noqa: E731
    rate = {a: r["replay"]["goodput_rate"] for a, r in results.items() if "replay" in r}
    # stalls are rare gaps (a few per aggressor among thousands): the tail past p99 shows them
    p999 = {a: percentiles(r["victim_itls_s"], (99.9,))["p99.9"] for a, r in results.items()}
    ttft = {a: {"victims": ttft_tail(r["victim_ttfts_s"]), "alone": ttft_tail(r["alone"]["victim_ttfts_s"])}
            for a, r in results.items()}
    over_alone = {a: div(t["victims"]["p99"], t["alone"]["p99"]) for a, t in ttft.items()}
    itl = lambda q: lambda x: x["itl_s"][q]  # noqa: E731
    gap = lambda x: round(x["max_gap_s"], 3)  # noqa: E731
    ttft99 = {a: t["victims"]["p99"] for a, t in ttft.items()}
    return {
        "ttft_p99_victims_over_alone_disagg": over_alone.get("disaggregated"),
        "ttft_p99_victims_over_alone_disagg_remote": over_alone.get(REMOTE),
        "ttft_p99_victims_over_alone": over_alone,
        "ttft_victims_s": ttft,
        "itl_p99_colocated_over_disagg": div(get("colocated", itl("p99")), get("disaggregated", itl("p99"))),
        "itl_p99_chunked_over_disagg": div(get("chunked", itl("p99")), get("disaggregated", itl("p99"))),
        "itl_p999_colocated_over_disagg": div(p999.get("colocated"), p999.get("disaggregated")),
        "itl_p999_chunked_over_disagg": div(p999.get("chunked"), p999.get("disaggregated")),
        "itl_p999_s": p999,
        "max_gap_disagg_s": get("disaggregated", gap),
        "max_gap_colocated_s": get("colocated", gap),
        "max_gap_chunked_s": get("chunked", gap),
        "ttft_p50_disagg_over_colocated": div(get("disaggregated", lambda x: x["ttft_s"]["p50"]),
                                              get("colocated", lambda x: x["ttft_s"]["p50"])),
        "goodput_disagg_over_colocated": div(rate.get("disaggregated"), rate.get("colocated")),
        "goodput_disagg_over_chunked": div(rate.get("disaggregated"), rate.get("chunked")),
        "goodput_rate": rate,
        # against llama.cpp's server (issue targets: ITL p50 <= 1.0, TTFT p99 and longest gap <= 0.5, goodput >= 1.5)
        "itl_p50_disagg_over_llama_server": div(get("disaggregated", itl("p50")), get(PEER, itl("p50"))),
        "itl_p99_disagg_over_llama_server": div(get("disaggregated", itl("p99")), get(PEER, itl("p99"))),
        "ttft_p99_disagg_over_llama_server": div(ttft99.get("disaggregated"), ttft99.get(PEER)),
        "max_gap_disagg_over_llama_server": div(get("disaggregated", gap), get(PEER, gap)),
        "goodput_disagg_over_llama_server": div(rate.get("disaggregated"), rate.get(PEER)),
    }


def ttfts(timings: list[Timing]) -> list[float]:
    """First-token times (s) of the requests that had one."""
    return [round(t.ttft, 5) for t in timings if t.ttft is not None]


def ttft_tail(times: list[float]) -> dict[str, float]:
    """p50, p99 and p99.9 of first-token times (s)."""
    return {k: round(v, 4) for k, v in percentiles(times, (50, 99, 99.9)).items() if k != "mean"}


def slo_for(trace: list[workloads.Request], args) -> Slo:
    """The replay's SLOs: absolute when both bounds are given, else from this machine's own
    isolated costs (bench/profile.reference: the trace's p90 prompt prefilled alone, a decode
    step at batch 8 of its median prompts, on all cores), so the same command means the same
    thing on a slower machine. Sets args.replay_slo_* to the seconds used."""
    if args.replay_slo_ttft is not None and args.replay_slo_tpot is not None:
        slo = Slo(args.replay_slo_ttft, args.replay_slo_tpot)
    else:
        lengths = [len(r.prompt) for r in trace]
        p90, p50 = int(np.percentile(lengths, 90)), int(np.percentile(lengths, 50))
        slo = from_reference(reference(p90, 8, p50), p90, p50, 8, args.ttft_x, args.tpot_x)
    args.replay_slo_ttft, args.replay_slo_tpot = round(slo.ttft_s, 3), round(slo.tpot_s, 4)
    return slo


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """make bench's settings (QUICK or FULL where not given)."""
    ap = argparse.ArgumentParser(prog="python -m bench.interference", description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help=f"longer runs: {FULL}")
    ap.add_argument("--duration", type=float, help="seconds of victim/aggressor arrivals")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], help="replay request rates")
    ap.add_argument("--replay-s", type=float, help="seconds of arrivals per replay rate")
    ap.add_argument("--scale", type=float, default=8, help="trace lengths divided by this")
    ap.add_argument("--victim-rate", type=float, default=0.3)
    ap.add_argument("--aggressor-rate", type=float, default=0.05)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="victims' TTFT bound, s")
    ap.add_argument("--slo-tpot", type=float, default=0.2, help="victims' TPOT bound, s")
    ap.add_argument("--replay-slo-ttft", type=float, help="replay's TTFT bound, s (with --replay-slo-tpot: "
                    "absolute SLOs instead of ones from this machine's costs)")
    ap.add_argument("--replay-slo-tpot", type=float, help="replay's TPOT bound, s")
    ap.add_argument("--ttft-x", type=float, default=4.0, help="replay's TTFT bound: this x the p90 prompt's "
                    "prefill alone, measured here")
    ap.add_argument("--tpot-x", type=float, default=2.0, help="replay's TPOT bound: this x a decode step at "
                    "batch 8, measured here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2", choices=sorted(NAMED), help="the stacks' and the peer's GGUF")
    ap.add_argument("--arms", type=lambda s: s.split(","), default=list(ALL_ARMS),
                    help=f"which arms, comma-separated (default: {','.join(ALL_ARMS)})")
    args = ap.parse_args(argv)
    if unknown := set(args.arms) - set(ALL_ARMS):
        ap.error(f"unknown arms {sorted(unknown)}: expected {', '.join(ALL_ARMS)}")
    if args.model != "smollm2" and args.replay_slo_ttft is None and args.replay_slo_tpot is None:
        args.replay_slo_ttft, args.replay_slo_tpot = 1.0, 0.1   # (the machine's reference costs are SmolLM2's)
    args.served = model_id(args.model)
    if (args.replay_slo_ttft is None) != (args.replay_slo_tpot is None):
        ap.error("--replay-slo-ttft and --replay-slo-tpot go together (neither: SLOs from this machine's costs)")
    for k, v in (FULL if args.full else QUICK).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main() -> None:
    args = parse()
    reqs = workloads.victims_and_aggressors(args.duration, args.victim_rate, aggressor_rate=args.aggressor_rate,
                                            seed=args.seed)
    trace = workloads.trace(AZURE, scale=args.scale, limit=max(8, round(max(args.rates) * args.replay_s)),
                            seed=args.seed)
    replay_slo = slo_for(trace, args)
    print(f"replay SLO: {replay_slo}", flush=True)
    results = {name: one_arm(name, serving, reqs, trace, args) for name, serving in servings(args).items()}
    for name, cfg in ((REMOTE, remote_arm), (PINNED, pinned_arm)):
        if name in args.arms:
            results[name] = one_arm(name, cfg(args.model), reqs, trace, args, replay=False)
    summary = summary_of(results)
    print(json.dumps(summary, indent=2))
    out = {"machine": machine(), "mode": "full" if args.full else "quick", "lent_cores": True, "argv": sys.argv[1:],
           "model": {"source": args.model, "file": NAMED[args.model]().name},
           "peer": peer.version(peer.BINARY) if PEER in results else None,
           "workload": {"seed": args.seed,
                        "victims_and_aggressors": {"duration_s": args.duration, "victim_rate": args.victim_rate,
                                                   "aggressor_rate": args.aggressor_rate, "requests": len(reqs),
                                                   "victim": "32-token prompt, 128 output tokens",
                                                   "aggressor": "1024-token prompt, 4 output tokens",
                                                   "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}},
                        "replay": {"trace": AZURE.name, "seconds_per_rate": args.replay_s, "scale": args.scale,
                                   "rates": args.rates, "mean_prompt_tokens": round(
                                       sum(len(r.prompt) for r in trace) / len(trace), 1),
                                   "mean_output_tokens": round(sum(r.max_tokens for r in trace) / len(trace), 1),
                                   "slo": {"ttft_s": args.replay_slo_ttft, "tpot_s": args.replay_slo_tpot,
                                           "how": replay_slo.how}}},
           "arms": results, "summary": summary}
    path = RESULTS / ("interference.json" if args.model == "smollm2" else f"interference-{args.model}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    report.write_all(out)


def servings(args) -> dict[str, AbstractContextManager[str]]:
    """The arms asked for, each a block that serves while it runs (opened one after the other)."""
    stacks: dict[str, AbstractContextManager[str]] = {
        name: stack_url(cfg) for name, cfg in arms(args.model).items() if name in args.arms}
    if PEER in args.arms:
        log = Path(__file__).parents[2] / ".run" / "llama-server.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        stacks[PEER] = peer.serving(NAMED[args.model](), log=log)
    return stacks


def machine() -> dict:
    """The cores and the CPU's model (lscpu's name: the figures differ between machines)."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": cpu_model() or platform.processor()}
