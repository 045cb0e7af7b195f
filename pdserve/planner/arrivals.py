"""Arrival times: Poisson, or gamma with a burstiness factor (vLLM's `--burstiness`: 1 is
Poisson, below 1 burstier, above 1 steadier), seeded."""

from __future__ import annotations

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets in seconds from the start of `n` arrivals at `rate` per second on average."""
    if rate <= 0 or rate == float("inf"):
        return [0.0] * n   # all at once
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]
