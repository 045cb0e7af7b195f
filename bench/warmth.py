"""What this machine charges for a cold cache: one small unit of the router's own work (a route
request decoded, its prompt's blocks hashed, the reply encoded) timed back to back, and after
an idle wait of each GAPS_MS. A service that waits between messages finds its code and data
partly evicted when the next one comes (by the other processes and, on a virtual machine, by
the host), and pays for it in CPU: a router at 100 req/s waits about 10 ms before every
placement, one at 1,000 req/s about 1 ms. `make bench-scale` and `make bench-stack` record
these figures beside their own (`machine.warmth`), measured in the same run.

    python -m bench.warmth        (prints the figures)
"""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np

from pdserve.shared.hashing import block_hashes
from pdserve.shared.messages import RouteReply, RouteRequest, Sampling

GAPS_MS = (1, 10)      # a router's wait at 1,000 and at 100 req/s (each beside back to back: 0)
COUNT = 200            # timings per gap (the 10 ms one takes 2 s)
PROMPT_TOKENS = 1_200  # a prompt of bench-scale's size (16-token blocks)
UNIT = f"decode a {PROMPT_TOKENS}-token route request, hash its 16-token blocks, encode the reply"


def unit():
    """The unit of work: a function of no arguments."""
    rng = random.Random(0)
    data = RouteRequest(request_id="warmth-0", prompt_token_ids=[rng.randrange(49_152) for _ in range(PROMPT_TOKENS)],
                        sampling=Sampling(max_tokens=64), model="m").encode()

    def work() -> None:
        req = RouteRequest.decode(data)
        block_hashes(req.prompt_token_ids, 16, req.sampling.cache_salt)
        RouteReply(request_id=req.request_id, ok=True, mode="remote", prefill_worker="p", decode_worker="d").encode()
    return work


def measure(cores: set[int] | None = None, gaps_ms: tuple[int, ...] = GAPS_MS, count: int = COUNT) -> dict:
    """The unit's p50 in µs back to back ("0") and after each gap, and each gap's as a multiple of
    back to back; run with this thread on `cores` (its own affinity given back after)."""
    work = unit()
    for _ in range(50):   # first calls: imports, caches of the libraries
        work()
    before = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        us = {}
        for gap in (0, *gaps_ms):
            xs = []
            for _ in range(count):
                if gap:
                    time.sleep(gap / 1e3)
                t = time.perf_counter_ns()
                work()
                xs.append((time.perf_counter_ns() - t) / 1e3)
            us[str(gap)] = round(float(np.median(xs)), 1)
    finally:
        os.sched_setaffinity(0, before)
    return {"unit": UNIT, "us_p50_after_gap_ms": us,
            "times_back_to_back": {g: round(v / us["0"], 2) for g, v in us.items() if g != "0"}}


def clause(warmth: dict | None) -> str:
    """The figures as words, for the results' text ('' when not measured)."""
    if not warmth:
        return ""
    us, times = warmth["us_p50_after_gap_ms"], warmth["times_back_to_back"]
    after = ", ".join(f"{times[g]:.1f}× after {g} ms idle" for g in times)
    return (f"this machine runs the same unit of the router's work ({warmth['unit']}) in {us['0']:.0f} µs back "
            f"to back, {after} (`bench/warmth.py`, the same run)")


if __name__ == "__main__":
    print(json.dumps(measure(), indent=2))
