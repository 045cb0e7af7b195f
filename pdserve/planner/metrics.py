"""Serving metrics from client-side timings (pure functions), with the definitions of vLLM's
serving benchmark so figures compare across servers:

- TTFT: from sending the request to its first token chunk.
- E2E: from sending to the last chunk.
- TPOT: (E2E − TTFT) / (output tokens − 1), per request (requests with one token have none).
- ITL: the gap before each chunk after the first, pooled over all requests.
- Goodput: completed requests meeting every SLO (TTFT ≤ a, TPOT ≤ b), per second of the
  run; SLO attainment: the fraction of all requests (failed ones count as misses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Timing:
    """One request as its client saw it: when it was sent, and for each chunk of tokens when
    it arrived and how many tokens it carried."""

    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    ok: bool = True
    error: str = ""
    prompt_tokens: int = 0

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.sent if self.chunks else None

    @property
    def e2e(self) -> float | None:
        return self.chunks[-1][0] - self.sent if self.chunks else None

    @property
    def tpot(self) -> float | None:
        n, e2e, ttft = self.output_tokens, self.e2e, self.ttft
        return (e2e - ttft) / (n - 1) if e2e is not None and ttft is not None and n > 1 else None

    @property
    def itls(self) -> list[float]:
        times = [t for t, _ in self.chunks]
        return [b - a for a, b in zip(times, times[1:])]


def percentiles(xs: list[float], ps: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """Mean and percentiles (linear interpolation, as numpy and vLLM); empty → zeros."""
    if not xs:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in ps}}
    arr = np.asarray(xs, dtype=float)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in ps}}


def meets(t: Timing, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    return t.ok and t.ttft is not None and t.ttft <= slo_ttft_s and (t.tpot is None or t.tpot <= slo_tpot_s)


def summarize(timings: list[Timing], duration_s: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    done = [t for t in timings if t.ok and t.chunks]
    good = [t for t in timings if meets(t, slo_ttft_s, slo_tpot_s)]
    itls = [g for t in done for g in t.itls]
    return {
        "requests": len(timings), "completed": len(done), "failed": len(timings) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_throughput": sum(t.output_tokens for t in done) / duration_s if duration_s else 0.0,
        "ttft_s": percentiles([t.ttft for t in done if t.ttft is not None]),
        "tpot_s": percentiles([t.tpot for t in done if t.tpot is not None]),
        "itl_s": percentiles(itls),
        "e2e_s": percentiles([t.e2e for t in done if t.e2e is not None]),
        "max_gap_s": max(itls, default=0.0),
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "goodput": len(good) / duration_s if duration_s else 0.0,
        "slo_attainment": len(good) / len(timings) if timings else 0.0,
    }


def rate_at_attainment(points: list[tuple[float, float]], target: float = 0.9) -> float:
    """Goodput as DistServe defines it: the highest request rate at which at least `target`
    of the requests meet their SLOs. `points` are (rate, attainment) measured at several
    rates; between the last rate that meets the target and the next that does not, the
    rate where the line between them crosses it. 0 when even the lowest rate misses."""
    pts = sorted(points)
    if not pts or pts[0][1] < target:
        return 0.0
    for (r0, a0), (r1, a1) in zip(pts, pts[1:]):
        if a1 < target:   # crossed between r0 and r1
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return pts[-1][0]
