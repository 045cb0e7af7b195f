"""How fast the simulator runs: a 10-minute trace at 1,000 requests/s on 64 workers.

    python -m pdserve.planner.speed [--profile bench/results/profile-cpu.json] [--rate 1000] [--seconds 600]

The Azure conversation trace's rows (full lengths), cycled and re-timed as Poisson arrivals, on
16 prefill + 48 decode workers whose costs are the profile's divided by --faster (default 600:
this CPU's workers could not carry 1,000 req/s at any count the sweep would try, and a
saturated fleet measures its backlog, not the simulator). Writes bench/results/sim_speed.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from pdserve.planner import workloads
from pdserve.planner.cluster import Layout, as_sim, simulate
from pdserve.planner.cost import Cost
from pdserve.planner.plan import AZURE, RESULTS
from pdserve.planner.slo import Slo, score
from pdserve.planner.worker import Knobs


def faster(cost: Cost, k: float) -> Cost:
    return dataclasses.replace(cost, prefill=tuple(c / k for c in cost.prefill),
                               decode_grid=tuple(tuple(s / k for s in row) for row in cost.decode_grid),
                               handoff_fixed_s=cost.handoff_fixed_s / k,
                               handoff_bytes_per_s=cost.handoff_bytes_per_s * k,
                               service_step_s=(cost.service_step_s[0] / k, cost.service_step_s[1] / k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=RESULTS / "profile-cpu.json")
    ap.add_argument("--rate", type=float, default=1000)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--faster", type=float, default=600)
    args = ap.parse_args()
    profile = json.loads(args.profile.read_text())
    cost = faster(Cost.of(profile, "1t"), args.faster)
    rows = workloads.trace(AZURE, scale=1, limit=5000)
    n = int(args.rate * args.seconds)
    times = workloads.arrival_times(n, args.rate, seed=0)
    reqs = as_sim(workloads.Request(t, rows[i % len(rows)].prompt, rows[i % len(rows)].max_tokens)
                  for i, t in enumerate(times))
    knobs = Knobs(kv_blocks=1 << 16, max_num_seqs=256, prefill_chunk=2048, max_batched_tokens=8192)
    layout = Layout("disaggregated", prefill=args.prefill, decode=args.decode, decode_cost=cost, prefill_cost=cost,
                    decode_knobs=knobs, prefill_knobs=knobs)
    start = time.perf_counter()
    out = simulate(layout, reqs)
    wall = time.perf_counter() - start
    s = score(out, Slo(2.0, 0.15), 0.0)
    summary = {"requests": n, "rate": args.rate, "simulated_s": out.duration_s, "workers": layout.workers,
               "wall_s": round(wall, 1), "target_wall_s": 60, "completed": s["completed"],
               "busy_mean": sum(out.busy.values()) / len(out.busy), "ttft_p90_s": s["ttft_s"]["p90"],
               "tpot_p90_s": s["tpot_s"]["p90"], "costs": f"profile {args.profile.name} 1t / {args.faster:g}"}
    print(json.dumps(summary, indent=1))
    (RESULTS / "sim_speed.json").write_text(json.dumps({"summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
