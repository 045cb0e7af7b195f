"""Victims and aggressors: does a long prompt freeze everyone else's tokens? Three arms on
the same cores, one after the other in one run, the same seeded workload each:

- colocated: one worker does prefill and decode, whole prompts in one pass (PD_PREFILL_CHUNK
  above the longest prompt), all cores;
- chunked: the same worker with chunked prefill (PD_PREFILL_CHUNK=128: a long prompt
  delays running streams by one chunk at a time);
- disaggregated: 1 prefill + 1 decode worker, each pinned to its own core (1 torch thread).

    python -m bench.interference [--duration 60] [--victim-rate 0.3] [--aggressor-rate 0.05]

Victims: 32-token prompts, 128 output tokens; aggressors: 1024-token prompts, 4 output tokens
(the issue's mix). Prints per arm TTFT/ITL/TPOT of the victims, the longest token gap, and
the ratios; writes bench/results/interference.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

from bench.load import workloads
from bench.load.client import run
from bench.load.metrics import summarize
from deploy.local.stack import Stack, StackConfig

ALL = set(range(os.cpu_count() or 1))


def arms() -> dict[str, StackConfig]:
    cores = sorted(ALL)
    split = ({cores[0]}, set(cores[1:]) or {cores[0]})
    whole = {"PD_PREFILL_CHUNK": "2048", "PD_MAX_BATCHED_TOKENS": "4096"}
    return {
        "colocated": StackConfig.on_free_ports(decode=1, colocated=True, kv_blocks=2048, threads=len(cores),
                                               env=whole),
        "chunked": StackConfig.on_free_ports(decode=1, colocated=True, kv_blocks=2048, threads=len(cores),
                                             env={"PD_PREFILL_CHUNK": "128", "PD_MAX_BATCHED_TOKENS": "4096"}),
        "disaggregated": StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=2048, threads=len(split[1]),
                                                   env=whole, cpus={"prefill-0": split[0], "decode-0": split[1]}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--victim-rate", type=float, default=0.3)
    ap.add_argument("--aggressor-rate", type=float, default=0.05)
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-tpot", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reqs = workloads.victims_and_aggressors(args.duration, args.victim_rate, aggressor_rate=args.aggressor_rate,
                                            seed=args.seed)
    results = {}
    for name, cfg in arms().items():
        start = time.monotonic()
        with Stack(cfg) as stack:
            asyncio.run(run(stack.url, "SmolLM2-135M-Instruct", workloads.shared_prefix(2, 1, 32, 8, 4)))  # warm
            timings, duration = asyncio.run(run(stack.url, "SmolLM2-135M-Instruct", reqs))
        victims = [t for r, t in zip(reqs, timings) if r.kind == "victim"]
        aggressors = [t for r, t in zip(reqs, timings) if r.kind == "aggressor"]
        results[name] = {"victims": summarize(victims, duration, args.slo_ttft, args.slo_tpot),
                         "aggressors": summarize(aggressors, duration, args.slo_ttft * 10, 10.0),
                         "wall_s": round(time.monotonic() - start, 1)}
        v = results[name]["victims"]
        print(f"{name:14} victims {v['completed']}/{v['requests']}: ITL p50 {v['itl_s']['p50'] * 1e3:6.1f} ms "
              f"p99 {v['itl_s']['p99'] * 1e3:7.1f} ms, max gap {v['max_gap_s']:5.2f} s, TTFT p50 "
              f"{v['ttft_s']['p50']:5.2f} s, TPOT p50 {v['tpot_s']['p50'] * 1e3:5.1f} ms, goodput {v['goodput']:.3f}/s",
              flush=True)
    co, ch, dis = (results[a]["victims"] for a in ("colocated", "chunked", "disaggregated"))
    div = lambda a, b: round(a / b, 3) if b else None  # noqa: E731
    summary = {
        "itl_p99_colocated_over_disagg": div(co["itl_s"]["p99"], dis["itl_s"]["p99"]),
        "itl_p99_chunked_over_disagg": div(ch["itl_s"]["p99"], dis["itl_s"]["p99"]),
        "max_gap_disagg_s": round(dis["max_gap_s"], 3),
        "ttft_p50_disagg_over_colocated": div(dis["ttft_s"]["p50"], co["ttft_s"]["p50"]),
        "victim_goodput_disagg_over_colocated": div(dis["goodput"], co["goodput"]),
    }
    print(json.dumps(summary, indent=2))
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "workload": {"kind": "victims and aggressors", **vars(args), "victim": "32-token prompt, 128 tokens",
                        "aggressor": "1024-token prompt, 4 tokens", "requests": len(reqs)},
           "arms": results, "summary": summary}
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/interference.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
