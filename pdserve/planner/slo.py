"""Service-level objectives and what a simulated run scores against them (pure functions).

SLOs travel between machines when they are set from the machine's own profile: TTFT ≤ k × the
isolated prefill of the workload's p90 prompt, TPOT ≤ k × the isolated decode step at the
expected batch (`relative`). The absolute form stays available; both print the seconds used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.planner.cluster import Layout, Outcome, simulate
from pdserve.planner.cost import Cost
from pdserve.planner.metrics import percentiles, rate_at_attainment, summarize


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    how: str = "absolute"

    def __str__(self) -> str:
        return f"TTFT <= {self.ttft_s:.3g} s, TPOT <= {self.tpot_s * 1e3:.0f} ms ({self.how})"


def relative(cost: Cost, prompts: list[int], ttft_x: float, tpot_x: float, batch: int = 8) -> Slo:
    """TTFT ≤ ttft_x × the p90 prompt prefilled alone; TPOT ≤ tpot_x × a decode step of
    `batch` sequences of the median prompt, both on `cost`'s worker."""
    p90, p50 = int(np.percentile(prompts, 90)), int(np.percentile(prompts, 50))
    return Slo(ttft_x * cost.prefill_s([(p90, 0)]), tpot_x * cost.decode_s(batch, batch * p50),
               f"{ttft_x:g} x prefill of the p90 prompt ({p90} tok), {tpot_x:g} x decode step at batch {batch}")


def from_reference(ref: dict, p90: int, p50: int, batch: int, ttft_x: float, tpot_x: float) -> Slo:
    """The same from isolated measurements (bench/profile.reference)."""
    return Slo(ttft_x * ref["prefill_s"], tpot_x * ref["decode_step_s"],
               f"{ttft_x:g} x prefill of the p90 prompt ({p90} tok) alone, {tpot_x:g} x a decode step at batch "
               f"{batch} ({p50}-token contexts), measured here")


def weighted_percentile(counts: dict[float, int], p: float) -> float:
    """The p-th percentile of values given as value → how many times."""
    return percentile_of(list(counts), list(counts.values()), p)


def percentile_of(values: Sequence[float], counts: Sequence[int], p: float) -> float:
    """The p-th percentile of `values`, each counted `counts[i]` times."""
    if not len(values):
        return 0.0
    v = np.asarray(values, dtype=float)
    order = np.argsort(v, kind="stable")
    cum = np.cumsum(np.asarray(counts)[order])
    return float(v[order][int(np.searchsorted(cum, p / 100 * cum[-1]))])


def score(out: Outcome, slo: Slo, overhead_s: float, kind: str | None = None) -> dict:
    """pdserve/planner/metrics.py's summary of a simulated run, plus the ITL tail from every gap."""
    s = summarize(out.timings(kind, overhead_s), out.duration_s, slo.ttft_s, slo.tpot_s)
    picked = [g for k, g in out.gaps.items() if kind is None or k == kind]
    values = [v for vs, _ in picked for v in vs]
    counts = [n for _, ns in picked for n in ns]
    s["itl_s"] = {f"p{p:g}": percentile_of(values, counts, p) for p in (50, 99, 99.9)}
    s["busy"], s["queued_tokens"], s["running"] = out.busy, out.queued_tokens, out.running
    return s


def point(layout: Layout, requests: list[tuple[float, int, int, str]], slo: Slo, rate: float) -> dict:
    """One rate of a sweep: `requests` (arriving at `rate`) simulated and scored."""
    s = score(simulate(layout, requests), slo, layout.overhead_s)
    return {"rate": rate, "slo_attainment": s["slo_attainment"], "ttft_p90_s": s["ttft_s"]["p90"],
            "tpot_p90_s": s["tpot_s"]["p90"], "itl_p99_s": s["itl_s"]["p99"], "busy": s["busy"],
            "queued_tokens": s["queued_tokens"], "running": s["running"]}


def goodput(layout: Layout, at_rate: Callable[[float], list[tuple[float, int, int, str]]], rates: list[float],
            slo: Slo) -> dict:
    """SLO attainment at each rate (`at_rate(rate)`: the requests arriving at that rate) and the
    goodput: the highest rate with >= 90% attainment (pdserve/planner/metrics.rate_at_attainment)."""
    points = [point(layout, at_rate(rate), slo, rate) for rate in rates]
    return {"points": points,
            "goodput_rate": rate_at_attainment([(p["rate"], p["slo_attainment"]) for p in points], 0.9)}


__all__ = ["Slo", "goodput", "percentiles", "point", "relative", "score", "weighted_percentile"]
