"""How many prefill and decode workers for a workload and its SLOs: `make plan`.

    python -m pdserve.planner.plan --trace bench/data/azure_conv_2023.csv \
        --profile bench/results/profile-cpu.json --workers 2 [--ttft 2 --tpot 0.15 | --ttft-x 4 --tpot-x 2]

For a budget of N workers (a worker: one core of the profile's machine, or one device), every
configuration: colocated (whole prompts, and chunked at each of --chunks: mixed passes of at
most twice the chunk's tokens) with workers of every shape the profile measured, and every
P:D split of N (the router's default placement: PD_PLACEMENT=cheapest). For each, the simulator
(planner/) replays the trace's requests at rising Poisson rates until fewer than 90% meet the
SLOs; goodput is the highest rate at which 90% do (DistServe's definition, as `make bench`).
Prints a table, the recommendation beside the best colocated configuration, and the signal each
pool's autoscaler should follow; writes plan-<trace>-<device>-<N>w.json and .png to --out
(default bench/results).
Predictions of a simulation: `make plan-check` says how close they come on this machine.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from pdserve.planner import workloads
from pdserve.planner.cluster import Layout, as_sim
from pdserve.planner.cost import STACKS, Cost, control_plane
from pdserve.planner.device import device_name
from pdserve.planner.slo import Slo, point, relative
from pdserve.planner.worker import Knobs
from pdserve.shared.progress import progress

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
AZURE = Path(__file__).resolve().parents[2] / "bench" / "data" / "azure_conv_2023.csv"
TARGET = 0.9


def shape_of(profile: dict, threads: int, alone: bool) -> str | None:
    """The profile's shape for a worker of `threads` cores, alone on the machine or beside busy
    ones (a device profile has one shape: its workers do not share compute)."""
    shapes = profile["shapes"]
    shared = any(s["neighbour"] for s in shapes.values())  # this machine's workers share its memory
    name = f"{threads}t+busy" if shared and not alone else f"{threads}t"
    return name if name in shapes else None


def layouts(profile: dict, workers: int, chunks: list[int]) -> list[Layout]:
    over = {s: control_plane(profile, s).get("ttft_overhead_s", 0.0) for s in STACKS}
    whole = Knobs(prefill_chunk=2048, max_batched_tokens=4096)
    out = []
    for threads in sorted({s["threads"] for s in profile["shapes"].values()}):
        if workers % threads:
            continue
        n = workers // threads
        shape = shape_of(profile, threads, alone=n == 1)
        if shape is None:
            print(f"  (colocated x{n} of {threads} cores: not in the profile, not planned)", flush=True)
            continue
        for chunk in [2048, *chunks]:
            out.append(Layout("colocated", decode=n, decode_cost=Cost.of(profile, shape, "colocated"),
                              decode_knobs=Knobs(prefill_chunk=chunk, max_batched_tokens=2 * chunk),
                              overhead_s=over["colocated"]))
    one = shape_of(profile, 1, alone=workers == 1)
    if one is not None:
        cost = Cost.of(profile, one, "disaggregated")
        out += [Layout("disaggregated", prefill=p, decode=workers - p, decode_cost=cost, prefill_cost=cost,
                       decode_knobs=whole, prefill_knobs=whole, overhead_s=over["disaggregated"])
                for p in range(1, workers)]
    return out


def search(layout: Layout, trace: list[workloads.Request], slo: Slo, seconds: float, seed: int) -> dict:
    """Goodput by rising rates (x1.5 from a low one until attainment drops below 90%), then four
    halvings of the last interval."""
    order = random.Random(seed).sample(range(len(trace)), len(trace))  # rows in one seeded order: no rate

    def attained(rate: float) -> dict:                                  # gets the trace's early hours only
        n = max(8, round(rate * seconds))
        reqs = workloads.retimed([trace[order[i % len(order)]] for i in range(n)], rate, seed=seed)
        return point(layout, as_sim(reqs), slo, rate)
    points: list[dict] = []
    rate = 0.05 * layout.workers
    while len(points) < 40:
        points.append(attained(rate))
        if points[-1]["slo_attainment"] < TARGET:
            break
        rate *= 1.5
    good = [p for p in points if p["slo_attainment"] >= TARGET]
    if not good:
        return {"goodput_rate": 0.0, "points": points, "at_goodput": points[0]}
    lo, hi = good[-1], points[-1]
    for _ in range(4):
        mid = attained((lo["rate"] + hi["rate"]) / 2)
        points.append(mid)
        lo, hi = (mid, hi) if mid["slo_attainment"] >= TARGET else (lo, mid)
    return {"goodput_rate": lo["rate"], "points": sorted(points, key=lambda p: p["rate"]), "at_goodput": lo}


def signals(layout: Layout, at: dict) -> dict:
    """What each pool's autoscaler should hold per worker (the HPAs of deploy/k8s read them as
    pd_queued_prompt_tokens and running sequences): their means at the goodput rate."""
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return {"queued_prompt_tokens_per_worker": mean(list(at["queued_tokens"].values())),
            "running_per_decode_worker": mean(list(at["running"].values())),
            "busy_prefill": mean([v for k, v in at["busy"].items() if k.startswith("prefill")]),
            "busy_decode": mean([v for k, v in at["busy"].items() if not k.startswith("prefill")])}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    names = [r["config"] for r in rows]
    ax.barh(names, [r["goodput_per_worker"] for r in rows],
            color=["tab:orange" if r["mode"] == "disaggregated" else "tab:blue" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("predicted goodput per worker (req/s at 90% SLO attainment)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=AZURE)
    ap.add_argument("--profile", type=Path, help="default: this machine's (bench/results/profile-<device>.json)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ttft", type=float, help="absolute TTFT bound, s")
    ap.add_argument("--tpot", type=float, help="absolute TPOT bound, s")
    ap.add_argument("--ttft-x", type=float, default=4.0, help="TTFT bound: this x the p90 prompt's isolated prefill")
    ap.add_argument("--tpot-x", type=float, default=2.0, help="TPOT bound: this x an isolated decode step at batch 8")
    ap.add_argument("--scale", type=float, default=8, help="trace lengths divided by this (as make bench)")
    ap.add_argument("--chunks", default="128,512", help="chunk sizes of the chunked colocated configurations")
    ap.add_argument("--seconds", type=float, default=60, help="seconds of arrivals per simulated rate")
    ap.add_argument("--requests", type=int, default=2000, help="trace rows used (cycled)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder the JSON and the plot go to")
    args = ap.parse_args(argv)
    if args.profile is None:
        args.profile = RESULTS / f"profile-{device_name()}.json"
    return args


def slo_of(profile: dict, trace: list[workloads.Request], args: argparse.Namespace) -> Slo:
    """The absolute bounds given, or bounds relative to the isolated costs of the machine's
    largest worker shape, alone (as make bench)."""
    if args.ttft and args.tpot:
        return Slo(args.ttft, args.tpot)
    shapes = profile["shapes"]
    base = max(shapes, key=lambda n: (shapes[n]["threads"], not shapes[n]["neighbour"]))
    return relative(Cost.of(profile, base), [len(r.prompt) for r in trace], args.ttft_x, args.tpot_x)


def simulate_all(profile: dict, trace: list[workloads.Request], slo: Slo, args: argparse.Namespace) -> list[dict]:
    """Every configuration that spends the whole budget (a worker of 2 cores: 2), searched for its
    goodput; one row each, printed as it finishes."""
    rows, budget = [], args.workers
    configs = layouts(profile, args.workers, [int(c) for c in args.chunks.split(",") if c])
    for layout in progress(configs, "simulating", unit="config"):
        found = search(layout, trace, slo, args.seconds, args.seed)
        at = found["at_goodput"]
        rows.append({"config": layout.name, "mode": layout.mode, "prefill": layout.prefill, "decode": layout.decode,
                     "prefill_chunk": layout.decode_knobs.prefill_chunk, "goodput_rate": found["goodput_rate"],
                     "goodput_per_worker": found["goodput_rate"] / budget,
                     "ttft_p90_s": at["ttft_p90_s"], "tpot_p90_s": at["tpot_p90_s"], "itl_p99_s": at["itl_p99_s"],
                     "signals": signals(layout, at), "points": found["points"]})
        r = rows[-1]
        print(f"  {r['config']:28} goodput {r['goodput_rate']:6.2f} req/s ({r['goodput_per_worker']:.2f}/worker), "
              f"TTFT p90 {r['ttft_p90_s']:.2f} s, TPOT p90 {r['tpot_p90_s'] * 1e3:.0f} ms, "
              f"ITL p99 {r['itl_p99_s'] * 1e3:.0f} ms", flush=True)
    return rows


def recommend(rows: list[dict], slo: Slo, started: float) -> dict:
    """The best configuration per worker beside the best colocated and disaggregated ones, and
    the signals their autoscalers follow; printed."""
    best = max(rows, key=lambda r: r["goodput_per_worker"])
    colocated = max((r for r in rows if r["mode"] == "colocated"), key=lambda r: r["goodput_per_worker"])
    disagg = [r for r in rows if r["mode"] == "disaggregated"]
    best_disagg = max(disagg, key=lambda r: r["goodput_per_worker"]) if disagg else None
    summary = {"recommended": best["config"], "recommended_goodput_per_worker": best["goodput_per_worker"],
               "best_colocated": colocated["config"], "best_colocated_goodput_per_worker":
               colocated["goodput_per_worker"],
               "best_disaggregated": best_disagg and best_disagg["config"],
               "disagg_over_colocated_per_worker": best_disagg and colocated["goodput_per_worker"] and
               best_disagg["goodput_per_worker"] / colocated["goodput_per_worker"],
               "signals": best["signals"], "signals_best_disaggregated": best_disagg and best_disagg["signals"],
               "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "how": slo.how},
               "simulated_s": round(time.monotonic() - started, 1)}
    print(f"recommended: {best['config']} ({best['goodput_per_worker']:.2f} req/s per worker); best colocated: "
          f"{colocated['config']} ({colocated['goodput_per_worker']:.2f})" +
          (f"; best disaggregated / best colocated per worker: {summary['disagg_over_colocated_per_worker']:.2f}"
           if best_disagg and colocated["goodput_per_worker"] else ""))
    for r in [best] + ([best_disagg] if best_disagg and best_disagg is not best else []):
        s = r["signals"]
        prefill = "the prefill pool" if r["mode"] == "disaggregated" else "each worker's prefill queue"
        print(f"autoscaling {r['config']} at its goodput rate: {prefill} {s['queued_prompt_tokens_per_worker']:.0f} "
              f"queued prompt tokens per worker; the decode pool {s['running_per_decode_worker']:.1f} running "
              f"sequences per worker (busy {s['busy_prefill']:.0%} prefill, {s['busy_decode']:.0%} decode)")
    return summary


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    started = time.monotonic()
    args = parse(argv, prog)
    profile = json.loads(args.profile.read_text())
    trace = workloads.trace(args.trace, scale=args.scale, limit=args.requests, seed=args.seed)
    slo = slo_of(profile, trace, args)
    print(f"plan for {args.trace.name} (lengths / {args.scale:g}) on {profile['device']} "
          f"({profile['machine']['cpus']} cpus), {args.workers} workers; SLO {slo}", flush=True)
    rows = simulate_all(profile, trace, slo, args)
    summary = recommend(rows, slo, started)
    stem = f"plan-{args.trace.stem}-{profile['device']}-{args.workers}w"
    out = {"trace": args.trace.name, "scale": args.scale, "profile": args.profile.name, "device": profile["device"],
           "machine": profile["machine"], "workers": args.workers, "seconds_per_rate": args.seconds,
           "simulated": True, "configs": rows, "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(out, indent=1) + "\n")
    wrote = f"{args.out / stem}.json"
    try:
        plot(rows, args.out / f"{stem}.png", f"{args.trace.name} / {args.scale:g}, {profile['device']}, "
             f"{args.workers} workers (simulated)\nTTFT <= {slo.ttft_s:.2f} s, TPOT <= {slo.tpot_s * 1e3:.0f} ms")
        wrote += " and .png"
    except ImportError:  # matplotlib: a dev dependency, not in the image
        wrote += " (no plot: matplotlib not installed)"
    print(f"wrote {wrote} in {summary['simulated_s']:.0f} s")

if __name__ == "__main__":
    main()
