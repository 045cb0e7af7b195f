"""Short prompts behind long ones on the disaggregated stack: placement × the prefill pool's
chunk, side by side in one run: `make bench-prefill-chunk`.

    python -m bench.interference.prefill_chunk [--duration 90] [--chunks 2048,256]
        [--placements cheapest,remote]

The victims-and-aggressors load of `make bench` (32-token chats at 0.3/s, 128 output tokens,
while 1024-token prompts with 4 output tokens arrive at 0.05/s; bench/interference/run.py), on its
disaggregated arm (1 prefill + 1 decode worker, one core each), for each placement
(`PD_PLACEMENT`) and each prefill-pool chunk (`PD_PREFILL_CHUNK` on the prefill worker, its
pass budget `PD_MAX_BATCHED_TOKENS` twice that, as make bench's chunked arm; the decode worker
keeps whole prompts in a pass, as make bench's arm): first the victims alone, then with the
aggressors. A victim arriving while a long prompt is in a prefill pass waits for that pass to
end: a smaller pass ends it sooner, and the victim shares the next pass with one chunk of the
long prompts (a budget of several chunks would let every waiting long prompt take one, and the
pass would be long again). The cheapest placement instead prefills such a victim
beside the decode worker's streams, which then wait through it (their inter-token tail).

Writes bench/results/prefill-chunk.json; `summary`: per arm the victims' TTFT p99 over their
TTFT p99 alone (`ttft_p99_over_alone`) and their inter-token p99 (`itl_p99_ms`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from bench.interference.run import one_arm
from bench.interference.stacks import arms
from pdserve.local.stack import StackConfig
from pdserve.planner import workloads

RESULTS = Path(__file__).parents[1] / "results" / "prefill-chunk.json"


def arm(placement: str, chunk: int) -> StackConfig:
    """make bench's disaggregated arm with this placement and this prefill-pool chunk."""
    cfg = arms()["disaggregated"]
    cfg.env = {**cfg.env, "PD_PLACEMENT": placement}
    cfg.worker_env = {"prefill-0": {"PD_PREFILL_CHUNK": str(chunk), "PD_MAX_BATCHED_TOKENS": str(2 * chunk)}}
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of victim/aggressor arrivals")
    ap.add_argument("--chunks", default="2048,256", help="prefill-pool chunk sizes (tokens)")
    ap.add_argument("--placements", default="cheapest,remote", help="PD_PLACEMENT values")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.slo_ttft, args.slo_tpot = 2.0, 0.2  # (interference's phases report attainment against these)
    reqs = workloads.victims_and_aggressors(args.duration, 0.3, aggressor_rate=0.05, seed=args.seed)
    results, summary = {}, {}
    for placement in args.placements.split(","):
        for chunk in (int(c) for c in args.chunks.split(",")):
            name = f"{placement}-chunk{chunk}"
            r = results[name] = one_arm(name, arm(placement, chunk), reqs, [], args, replay=False)
            p99, alone = r["victims"]["ttft_s"]["p99"], r["alone"]["victims"]["ttft_s"]["p99"]
            summary[name] = {"ttft_p99_over_alone": round(p99 / alone, 3) if alone else None,
                             "ttft_p99_s": round(p99, 3), "ttft_p99_alone_s": round(alone, 3),
                             "itl_p99_ms": round(r["victims"]["itl_s"]["p99"] * 1e3, 1),
                             "itl_p50_ms": round(r["victims"]["itl_s"]["p50"] * 1e3, 1)}
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "workload": {"duration_s": args.duration, "requests": len(reqs), "seed": args.seed,
                        "victim": "32-token prompt, 128 output tokens, 0.3/s",
                        "aggressor": "1024-token prompt, 4 output tokens, 0.05/s"},
           "arms": results, "summary": summary}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
