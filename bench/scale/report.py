"""`make bench-scale`'s summary, against the issue's targets, and its plot (pure, from the runs).

Targets: placement decision p99 ≤ 2 ms at W=256, B=10M, 1000 req/s; p99 at W=256 ≤ 1.5 × p99
at W=4 (same B and rate); Redis ≤ 100 bytes per indexed block; NATS messages per request
independent of W. A target not met names what stopped it where the counters show it: a
process at a full core, the machine's cores all busy, or the offered rate not reached.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from bench import warmth  # noqa: E402

DECISION_P99_MS = 2.0
GROWTH = 1.5
BYTES_PER_BLOCK = 100.0
NATS_SPREAD = 0.1     # msgs per request at W=256 within 10% of W=4's: "independent of W"
ROUTER_CPU_MS = 1.0   # router CPU per placement: 1,000 placements/s on a core
DECISION_P99_MS_R100 = 5.0    # unsaturated (W=256, B=10M, 100 req/s): p99 at most this
TAIL_OVER_MEDIAN = 1.5        # ... and at most this times its p50
SATURATED_PCT = 90.0
KEPT_UP = 0.95        # achieved / offered rate of a run the router kept up with


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p99": None, "mean": None, "n": 0}
    a = np.asarray(xs)
    return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "mean": round(float(a.mean()), 3), "n": len(xs)}


def bottleneck(row: dict, cores: int) -> str:
    """What the counters say limited this run, in words, with every process's CPU."""
    cpu = {k: v for k, v in row["cpu_pct"].items() if k not in ("machine", "other")}
    notes = []
    if row["cpu_pct"]["machine"] >= SATURATED_PCT * cores:
        notes.append(f"machine CPU saturated ({row['cpu_pct']['machine']:.0f}% of {cores} cores)")
    hot = [f"{k} {v:.0f}%" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= SATURATED_PCT]
    if hot:
        notes.append("at a full core: " + ", ".join(hot))
    if not kept_up(row):
        notes.append(f"placed {row['achieved_rate']:.0f} of {row['offered_rate']:.0f} req/s offered "
                     f"({row.get('refused', 0)} refused, {row.get('timed_out', 0)} unanswered in time, "
                     f"{row.get('router_failed', 0)} failed)")
    usage = ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
    return f"{'; '.join(notes) or 'no CPU saturated; rate reached'} (CPU, % of a core: {usage}, " \
           f"outside the benchmark {row['cpu_pct']['other']:.0f}){admits(row)}"


def admits(row: dict) -> str:
    """The admit wait's p99 in its three parts (drive.admit_split), as words; '' if not measured."""
    legs = row.get("admit_ms") or {}
    if not all((legs.get(k) or {}).get("p99") is not None for k in ("to_worker", "worker", "back")):
        return ""
    late = row.get("fleet_late_ms") or {}
    return (f"; the admit wait at p99: {legs['to_worker']['p99']:.1f} ms to the simulated decode worker, "
            f"{legs['worker']['p99']:.1f} ms its answer, {legs['back']['p99']:.1f} ms back"
            + (f" (the fleet's loop late by {late['p50']:.1f} / {late['p99']:.1f} ms p50 / p99, sampled each "
               f"{late.get('every_ms', 10):g} ms)" if late.get("p99") is not None else ""))


def find(runs: list[dict], workers: int, blocks: int | None, rate: float | None, replicas: int = 1) -> dict | None:
    return next((r for r in runs if (r["workers"], r["blocks"], r["rate"], r["replicas"]) ==
                 (workers, blocks, rate, replicas)), None)


def growth(runs: list[dict], field: str = "decision_ms", at: dict | None = None) -> tuple[float | None, dict, dict]:
    """p99 at W=256 / p99 at W=4 for each (B, rate) measured with both; the headline is the
    largest growth among the cells where the router kept up with both (else the largest
    cell), or the cell `at`: one slow W=4 run (a p99 from a few hundred decisions) cannot
    make the target look met."""
    cells = {}
    for r in runs:
        lo = find(runs, 4, r["blocks"], r["rate"])
        hi_p99, lo_p99 = (r.get(field) or {}).get("p99"), ((lo or {}).get(field) or {}).get("p99")
        if r["workers"] == 256 and r["replicas"] == 1 and lo and hi_p99 and lo_p99:
            cells[(r["blocks"], r["rate"])] = (round(hi_p99 / lo_p99, 3), kept_up(r) and kept_up(lo))
    if not cells:
        return None, {}, {}
    b, rate = (at["blocks"], at["rate"]) if at else \
        max((k for k, (_, ok) in cells.items() if ok), key=lambda k: cells[k][0], default=max(cells))
    if (b, rate) not in cells:
        return None, {}, {}
    return cells[(b, rate)][0], {"blocks": b, "rate": rate}, {f"B={k[0]} rate={k[1]}": v for k, (v, _) in cells.items()}


def kept_up(r: dict) -> bool:
    """The router kept up: every request placed in time at the offered rate."""
    return not (r.get("timed_out") or r.get("router_failed") or r.get("refused")) and \
        r["achieved_rate"] >= KEPT_UP * r["offered_rate"]


def nats_per_request(runs: list[dict], workers: int) -> float | None:
    """Mean over that W's single-router runs the router kept up with (an overloaded router's
    refused, failed and late routes send messages that no placement accounts for)."""
    mine = [r for r in runs if r["workers"] == workers and r["replicas"] == 1]
    xs = [r["nats_per_request"]["net_in"] for r in ([r for r in mine if kept_up(r)] or mine)]
    return round(float(np.mean(xs)), 2) if xs else None


def router_cpu(runs: list[dict], rate: float | None = None) -> dict[str, float]:
    """Router CPU ms per placement by W (mean over the single-router runs it kept up with, at
    `rate` or at every rate, less its idle rate): 1000 / this is what one core of router can
    place per second."""
    out = {}
    for w in sorted({r["workers"] for r in runs}):
        xs = [r["router_cpu_ms_per_placement"]["net"] for r in runs
              if r["workers"] == w and r["replicas"] == 1 and kept_up(r) and rate in (None, r["rate"])]
        if xs:
            out[f"w{w}"] = round(float(np.mean(xs)), 2)
    return out


def registry_reads(runs: list[dict]) -> dict:
    """A router's registry read at each W (median over its runs): the whole registry, and the
    changes since the last read (what routers read now)."""
    out = {}
    for w in sorted({r["workers"] for r in runs if r.get("registry_read_ms")}):
        reads = [r["registry_read_ms"] for r in runs if r["workers"] == w and r.get("registry_read_ms")]
        out[f"w{w}"] = {k: round(float(np.median([x[k] for x in reads])), 3) for k in ("whole", "changes")}
    return out


def cpu_words(by_rate: dict[str, dict[str, float]], cold: dict | None) -> str:
    """What limits the router's CPU per placement, in words: the figures at each rate, and what
    the machine charges a process that waited (bench/warmth.py)."""
    at = "; ".join(f"{r[1:]} req/s: " + ", ".join(f"W={w[1:]} {v:.2f} ms" for w, v in ws.items())
                   for r, ws in by_rate.items() if ws)
    why = warmth.clause(cold)
    return f"{at}" + (f". The same code costs more the longer it waited: {why}" if why else "")


def summary(runs: list[dict], cores: int, cold: dict | None = None) -> dict:
    """The issue's figures and targets, and what limited those not met; `cold`: the machine's
    price of a wait (bench/warmth.py), beside the router's CPU."""
    target = find(runs, 256, 10_000_000, 1000)
    ratio, at, by_cell = growth(runs)
    largest = max((r["blocks"] for r in runs), default=0)
    per_block = max((r["redis_bytes_per_block"] for r in runs if r["blocks"] == largest), default=None)
    n4, n256 = nats_per_request(runs, 4), nats_per_request(runs, 256)
    checked = [r["decisions"]["hit_rate_same_as_policy"] for r in runs
               if r["decisions"]["hit_rate_same_as_policy"] is not None]
    own_ratio, own_at, _ = growth(runs, "decision_own_ms", at=at or None)
    calm = find(runs, 256, 10_000_000, 100)
    cpu = router_cpu(runs)
    by_rate = {f"r{rate:g}": router_cpu(runs, rate) for rate in sorted({r["rate"] for r in runs})}
    s: dict[str, Any] = {"decision_p99_ms_w256_b10m_r1000": target["decision_ms"]["p99"] if target else None,
         "decision_p99_growth_w4_to_w256": ratio, "growth_measured_at": at, "growth_by_cell": by_cell,
         # the same without the wait for the simulated decode workers' admit answers
         "router_own_p99_growth_w4_to_w256": own_ratio if own_at == at else None,
         "redis_bytes_per_block": per_block, "redis_bytes_per_block_at_blocks": largest,
         "nats_msgs_per_request_w4": n4, "nats_msgs_per_request_w256": n256,
         "router_cpu_ms_per_placement": cpu, "router_cpu_ms_per_placement_w256": cpu.get("w256"),
         "router_cpu_ms_per_placement_by_rate": by_rate,
         "warmth_times_back_to_back": cold["times_back_to_back"] if cold else None,
         "decision_p99_ms_w256_b10m_r100": calm["decision_ms"]["p99"] if calm else None,
         "decision_p50_ms_w256_b10m_r100": calm["decision_ms"]["p50"] if calm else None,
         "admit_ms_w256_b10m_r100": calm.get("admit_ms") if calm else None,
         "registry_read_ms": registry_reads(runs),
         "hit_rate_same_as_policy": bool(checked) and all(checked),
         "hit_rate_checked_runs": f"{len(checked)} of {len(runs)}: those the router kept up with (an overloaded "
                                  "router's bookings cannot be rebuilt from outside)"}
    met = {"decision_p99_ms_w256_b10m_r1000": None if s["decision_p99_ms_w256_b10m_r1000"] is None
           else s["decision_p99_ms_w256_b10m_r1000"] <= DECISION_P99_MS,
           "decision_p99_growth_w4_to_w256": None if ratio is None else ratio <= GROWTH,
           "redis_bytes_per_block": None if per_block is None else per_block <= BYTES_PER_BLOCK,
           "nats_msgs_per_request_independent_of_w": None if not (n4 and n256) else abs(n256 - n4) <= NATS_SPREAD * n4,
           "hit_rate_same_as_policy": s["hit_rate_same_as_policy"],
           "router_cpu_ms_per_placement": max(cpu.values()) <= ROUTER_CPU_MS if cpu else None,
           "decision_p99_ms_w256_b10m_r100": None if not calm or calm["decision_ms"]["p99"] is None else
           calm["decision_ms"]["p99"] <= min(DECISION_P99_MS_R100, TAIL_OVER_MEDIAN * calm["decision_ms"]["p50"])}
    s["targets_met"] = met
    limiting = {"decision_p99_ms_w256_b10m_r1000": target, "decision_p99_ms_w256_b10m_r100": calm,
                "decision_p99_growth_w4_to_w256": find(runs, 256, at.get("blocks"), at.get("rate"))}
    s["limited_by"] = {k: bottleneck(row, cores) for k, row in limiting.items() if row and met.get(k) is False}
    if met["router_cpu_ms_per_placement"] is False:
        s["limited_by"]["router_cpu_ms_per_placement"] = cpu_words(by_rate, cold)
    return s


def plot(runs: list[dict], path: Path) -> None:
    """Decision p99 against W, one line per (B, rate); the replicas' points marked."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b, rate in sorted({(r["blocks"], r["rate"]) for r in runs if r["replicas"] == 1}):
        pts = sorted((r["workers"], r["decision_ms"]["p99"]) for r in runs
                     if (r["blocks"], r["rate"], r["replicas"]) == (b, rate, 1) and r["decision_ms"]["p99"])
        if pts:
            ax.plot(*zip(*pts), "o-", label=f"B={b:,} blocks, {rate:g} req/s")
    for r in runs:
        if r["replicas"] > 1 and r["decision_ms"]["p99"]:
            ax.plot(r["workers"], r["decision_ms"]["p99"], "k*", markersize=11,
                    label=f"{r['replicas']} routers, B={r['blocks']:,}, {r['rate']:g} req/s")
    ax.axhline(DECISION_P99_MS, color="grey", ls="--", lw=1, label=f"target {DECISION_P99_MS:g} ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ms = FuncFormatter(lambda y, _: f"{y:g}" if f"{y:.0e}"[0] in "125" else "")   # 1, 2, 5, 10, 20, 50…
    ax.yaxis.set_major_formatter(ms)
    ax.yaxis.set_minor_formatter(ms)
    ax.set_xticks(sorted({r["workers"] for r in runs}), [str(w) for w in sorted({r["workers"] for r in runs})])
    ax.set_xlabel("simulated workers W")
    ax.set_ylabel("placement decision p99 (ms, router.route span)")
    ax.set_title("Placement decision time against fleet size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _script_names() -> dict[str, str]:
    """sha1 -> name of the project's Lua scripts (the slow log names them by sha)."""
    from pdserve.shared import prefix_index, state
    return {hashlib.sha1(src.encode()).hexdigest(): f"script {name.strip('_').lower()}"
            for module in (prefix_index, state) for name, src in vars(module).items()
            if name.startswith("_") and name[1:].isupper() and isinstance(src, str) and "redis.call" in src}


SCRIPTS = _script_names()


def slow_commands(entries: list[dict]) -> dict:
    """Redis's slow log over a run (commands over 1 ms), by command: how many, the longest."""
    out: dict[str, dict] = {}
    for e in entries:
        command = e["command"]
        words = (command.decode(errors="replace") if isinstance(command, bytes) else str(command)).split()
        command = words[0].upper()
        if command == "EVALSHA" and len(words) > 1:
            command = SCRIPTS.get(words[1], f"EVALSHA {words[1][:8]}")
        row = out.setdefault(command, {"count": 0, "max_ms": 0.0, "total_ms": 0.0})
        row["count"] += 1
        row["max_ms"] = round(max(row["max_ms"], e["duration"] / 1e3), 3)
        row["total_ms"] = round(row["total_ms"] + e["duration"] / 1e3, 3)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["total_ms"]))


def stores(runs: list[dict]) -> dict:
    """With runs on more than one store (`--stores`): each cell's figures by store, side by side."""
    if len({r["store"] for r in runs}) < 2:
        return {}
    cells: dict[str, dict] = {}
    for r in runs:
        if r["replicas"] == 1:
            cells.setdefault(f"w{r['workers']}-b{r['blocks']}-r{r['rate']:g}", {})[r["store"]] = {
                "decision_p50_ms": r["decision_ms"]["p50"], "decision_p99_ms": r["decision_ms"]["p99"],
                "achieved_rate": r["achieved_rate"],
                "router_cpu_ms_per_placement": (r.get("router_cpu_ms_per_placement") or {}).get("net"),
                "redis_cpu_ms_per_placement": (r.get("redis_cpu_ms_per_placement") or {}).get("net")}
    return {"by_store": cells}
