"""bench/warmth.py: the machine's price of a wait, as bench-scale and bench-stack record it."""

from __future__ import annotations

import os

from bench import warmth


def test_the_unit_is_timed_after_each_gap_and_the_thread_gets_its_cores_back():
    before = os.sched_getaffinity(0)
    w = warmth.measure(cores={min(before)}, gaps_ms=(1,), count=5)
    assert os.sched_getaffinity(0) == before
    assert set(w["us_p50_after_gap_ms"]) == {"0", "1"} and all(v > 0 for v in w["us_p50_after_gap_ms"].values())
    assert w["times_back_to_back"] == {"1": round(w["us_p50_after_gap_ms"]["1"] / w["us_p50_after_gap_ms"]["0"], 2)}


def test_the_figures_read_as_a_clause():
    w = {"unit": "u", "us_p50_after_gap_ms": {"0": 97.1, "1": 167.0, "10": 226.0},
         "times_back_to_back": {"1": 1.72, "10": 2.33}}
    assert warmth.clause(w) == ("this machine runs the same unit of the router's work (u) in 97 µs back to back, "
                                "1.7× after 1 ms idle, 2.3× after 10 ms idle (`bench/warmth.py`, the same run)")
    assert warmth.clause(None) == ""
