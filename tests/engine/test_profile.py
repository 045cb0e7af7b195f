"""The planner's isolated measurements with the real model (bench/planning/profile.py's reference,
which `make bench` sets its SLOs from), and the make-bench SLOs that come of them."""

from __future__ import annotations

import argparse
import os

import pytest

from bench.interference.run import slo_for
from bench.planning.profile import references
from pdserve.planner.workloads import Request

pytestmark = pytest.mark.slow


def test_reference_costs_grow_with_the_work():
    # (32 sequences of 16x the context: about 15x the step here, so a busy machine's noise does not reorder them;
    # on one core, which the measuring process inherits: torch's threads on a core another process takes wait on
    # each other, and a short step measured so took 3x a long one)
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        short, long = references([(16, 1, 32), (512, 32, 512)], reps=2)
    finally:
        os.sched_setaffinity(0, cpus)
    for r in (short, long):
        assert 0 < r["prefill_s"] < 60 and 0 < r["decode_step_s"] < 10
    assert long["prefill_s"] > short["prefill_s"]          # 32x the tokens
    assert long["decode_step_s"] > short["decode_step_s"]


def test_make_bench_slos_are_this_machines_unless_given():
    trace = [Request(0.0, [1] * n, 8) for n in (32, 64, 128, 256)]
    given = argparse.Namespace(replay_slo_ttft=2.0, replay_slo_tpot=0.15, ttft_x=4, tpot_x=2)
    assert (slo_for(trace, given).ttft_s, given.replay_slo_tpot) == (2.0, 0.15)
    measured = argparse.Namespace(replay_slo_ttft=None, replay_slo_tpot=None, ttft_x=4, tpot_x=2)
    slo = slo_for(trace, measured)
    assert slo.how.startswith("4 x prefill of the p90 prompt (")
    assert measured.replay_slo_ttft == round(slo.ttft_s, 3) > 0 and measured.replay_slo_tpot > 0
