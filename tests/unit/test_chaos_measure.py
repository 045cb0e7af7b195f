"""bench/chaos/measure.py: what a fault cost, from arrival times and request events."""

from __future__ import annotations

from bench.chaos.measure import Stream, cost, gaps, p99

ROUTED = {"event": "routed", "reason": "prefill pool", "mode": "remote", "attempt": 0}
STEADY = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]


def test_p99_and_gaps():
    assert p99([]) is None and p99([3.0]) == 3.0 and p99([float(i) for i in range(1, 201)]) == 198.0
    assert gaps([1.0, 2.0, 4.0, 7.0], after=2.0, until=7.0) == [2.0, 3.0]


def test_survivors_gaps_during_the_recovery_against_before_and_the_moved_streams_recovery():
    slowed = [0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8]      # 0.2 s gaps once the fault struck at 0.35
    out = cost([Stream(STEADY, STEADY, [ROUTED]),
                Stream(slowed, [0.0, 0.1, 0.2, 0.3, 0.4, 0.55, 0.6], [ROUTED]),
                Stream([0.0, 0.1, 0.2, 0.3, 1.5, 1.6], STEADY[:6],   # failed over: next token 1.15 s later
                       [ROUTED, {"event": "failover", "attempt": 1}]),
                Stream([1.0, 1.1], [0.5, 0.6],                       # its job moved: first token at 1.0
                       [ROUTED, {**ROUTED, "reason": "requeued from p0 (gone): ..."}]),
                Stream([0.9, 1.0], [0.8, 0.9], [ROUTED, {"event": "prefill_local"}])], fault_at=0.35)
    assert out["moved_streams"] == 3 and out["moved_recovery_s"] == 1.15 and out["survivors"] == 2
    assert out["moved_delay_s"] == 1.1   # the failed-over stream ended at 1.6 instead of 0.5
    # (the one prefilled on its decode worker, no prefill worker left, moved too: 0.1 s later)
    assert out["itl_p99_before_s"] == 0.1 and out["itl_p99_during_s"] == 0.2 and out["itl_p99_reference_s"] == 0.15
    assert out["itl_p99_during_over_before"] == 2.0 and out["itl_p99_during_over_reference"] == 1.33
    assert out["local_recomputes"] == 1


def test_a_failover_placed_on_its_decode_worker_counts_as_a_local_recompute():
    events = [ROUTED, {"event": "failover", "attempt": 1}, {**ROUTED, "mode": "local", "attempt": 1}]
    assert cost([Stream([0.0, 1.0, 2.0], [0.0, 1.0, 2.0], events)], fault_at=0.5)["local_recomputes"] == 1
