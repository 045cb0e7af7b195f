"""What a worker's weights' format does to everyone's tokens under a mixed load: `make bench`'s
victims and aggressors (32-token chats at 0.3/s, 128 output tokens, while 1024-token prompts
with 4 output tokens arrive at 0.05/s; bench/interference/run.py) on its disaggregated arm (1
prefill + 1 decode worker, one core each), once with both pools on `fp32` and once on `native`
(PD_WEIGHTS), one after the other: the victims' inter-token p50/p99, longest gap and TTFT p99.
`make bench-engine` runs it; alone, it replaces the `mixed_load` part of
bench/results/engine.json and its summary keys, and rewrites RESULTS.md's engine block:

    python -m bench.engine.mixed_load [--duration 90]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.engine import readme as engine_readme
from bench.interference.run import one_arm
from bench.interference.stacks import arms
from pdserve.planner import workloads

FORMATS = ("fp32", "native")


def measure(duration: float, seed: int = 0) -> dict:
    """Per format: the victims' figures (ms and s) with the aggressors, and TTFT p99 alone."""
    args = argparse.Namespace(slo_ttft=2.0, slo_tpot=0.2)  # (the phases report attainment against these)
    reqs = workloads.victims_and_aggressors(duration, 0.3, aggressor_rate=0.05, seed=seed)
    out: dict = {"duration_s": duration, "requests": len(reqs),
                 "arm": "make bench's disaggregated arm (1P+1D, a core each)", "formats": {}}
    for fmt in FORMATS:
        cfg = arms()["disaggregated"]
        cfg.env = {**cfg.env, "PD_WEIGHTS": fmt}
        v = one_arm(f"weights {fmt}", cfg, reqs, [], args, replay=False)
        vic = v["victims"]
        out["formats"][fmt] = {"itl_p50_ms": round(vic["itl_s"]["p50"] * 1e3, 1),
                               "itl_p99_ms": round(vic["itl_s"]["p99"] * 1e3, 1),
                               "max_gap_s": round(vic["max_gap_s"], 3), "ttft_p99_s": round(vic["ttft_s"]["p99"], 3),
                               "ttft_p99_alone_s": round(v["alone"]["victims"]["ttft_s"]["p99"], 3),
                               "completed": vic["completed"], "requests": vic["requests"]}
    return out


def summary(mixed: dict) -> dict:
    f = mixed["formats"]
    return {f"mixed_{k}_{fmt}": f[fmt][k] for fmt in FORMATS for k in ("itl_p99_ms", "max_gap_s", "ttft_p99_s")}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.engine.mixed_load", description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of victim/aggressor arrivals")
    mixed = measure(ap.parse_args().duration)
    path = Path(__file__).parents[1] / "results" / "engine.json"
    result = json.loads(path.read_text())
    result["mixed_load"] = mixed
    result["summary"].update(summary(mixed))
    path.write_text(json.dumps(result, indent=1) + "\n")
    engine_readme.write(result)
    print(json.dumps(mixed, indent=1))


if __name__ == "__main__":
    main()
