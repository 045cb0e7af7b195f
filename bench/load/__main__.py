"""Load generator for any OpenAI-compatible server.

    python -m bench.load --base-url http://127.0.0.1:8000 --workload victims --duration 60
    python -m bench.load --base-url URL --workload bench/data/azure_conv_2023.csv --scale 16 \\
        --limit 200 --rate 1.5
    python -m bench.load --base-url URL --workload shared-prefix --requests 64 --concurrency 8

Workloads: `victims` (short chats streaming while long prompts arrive), `shared-prefix`, or
a trace file in the Azure CSV or Mooncake JSONL format (lengths divided by --scale).
Arrivals: the trace's own, or --rate (Poisson; --burstiness for gamma), or --concurrency N
(closed loop). Prints TTFT, TPOT, ITL and E2E p50/p90/p99, throughput, goodput under
--slo-ttft / --slo-tpot and SLO attainment; --out writes the summary and every timing as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from pathlib import Path

from bench.load.client import run
from pdserve.planner import workloads
from pdserve.planner.metrics import summarize


def build(args) -> list[workloads.Request]:
    if args.workload == "victims":
        return workloads.victims_and_aggressors(args.duration, seed=args.seed)
    if args.workload == "shared-prefix":
        return workloads.shared_prefix(args.requests, rate=args.rate or 1.0, seed=args.seed)
    reqs = workloads.trace(args.workload, scale=args.scale, limit=args.limit or args.requests, seed=args.seed)
    return workloads.retimed(reqs, args.rate, args.burstiness, args.seed) if args.rate else reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--workload", default="victims", help="victims, shared-prefix, or a .csv / .jsonl trace file")
    ap.add_argument("--scale", type=float, default=16, help="trace lengths divided by this")
    ap.add_argument("--limit", type=int, default=0, help="first N trace requests")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--duration", type=float, default=60, help="victims: seconds of arrivals")
    ap.add_argument("--rate", type=float, default=0, help="requests/s (Poisson); 0: the trace's own times")
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=0, help="closed loop with N in flight (ignores arrivals)")
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.2, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    reqs = build(args)
    timings, duration = asyncio.run(run(args.base_url, args.model, reqs, args.concurrency))
    summary = summarize(timings, duration, args.slo_ttft, args.slo_tpot)
    print(json.dumps(summary, indent=2))
    errors = {t.error for t in timings if not t.ok}
    if errors:
        print(f"errors: {sorted(errors)[:5]}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary,
                                              "requests": [{"kind": r.kind, "at": r.at, **asdict(t)}
                                                           for r, t in zip(reqs, timings)]}, indent=1))


if __name__ == "__main__":
    main()
