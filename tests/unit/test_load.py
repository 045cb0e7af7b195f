"""The load generator's metric functions against scripted token timings (exact values), its
arrival process, and its workloads (trace scaling, Mooncake prefix sharing)."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.planner import workloads
from pdserve.planner.arrivals import arrival_times
from pdserve.planner.metrics import Timing, percentiles, rate_at_attainment, summarize

TRACES = __import__("pathlib").Path(__file__).resolve().parents[2] / "bench" / "data"


def test_ttft_tpot_itl_and_e2e_follow_vllms_definitions():
    t = Timing(sent=10.0, chunks=[(10.5, 1), (10.6, 1), (10.8, 2), (11.1, 1)])   # 5 tokens in 4 chunks
    assert t.ttft == pytest.approx(0.5) and t.e2e == pytest.approx(1.1)
    assert t.tpot == pytest.approx((1.1 - 0.5) / 4)                               # (E2E - TTFT) / (tokens - 1)
    assert t.itls == pytest.approx([0.1, 0.2, 0.3])                               # a gap per chunk after the first
    assert Timing(sent=0, chunks=[(0.3, 1)]).tpot is None


def test_summary_percentiles_goodput_and_attainment():
    fast = Timing(sent=0.0, chunks=[(0.2, 1), (0.3, 1), (0.4, 1)])      # TTFT 0.2, TPOT 0.1
    slow_start = Timing(sent=1.0, chunks=[(3.0, 1), (3.1, 1)])          # TTFT 2.0: misses a 1 s TTFT SLO
    slow_tokens = Timing(sent=2.0, chunks=[(2.1, 1), (2.6, 1)])         # TPOT 0.5: misses a 0.2 s TPOT SLO
    failed = Timing(sent=3.0, ok=False, error="HTTP 503")
    s = summarize([fast, slow_start, slow_tokens, failed], duration_s=4.0, slo_ttft_s=1.0, slo_tpot_s=0.2)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["goodput"] == pytest.approx(1 / 4.0) and s["slo_attainment"] == pytest.approx(1 / 4)
    assert s["output_throughput"] == pytest.approx(7 / 4.0) and s["request_throughput"] == pytest.approx(3 / 4.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2) and s["ttft_s"]["mean"] == pytest.approx((0.2 + 2.0 + 0.1) / 3)
    assert s["itl_s"]["p50"] == pytest.approx(0.1) and s["max_gap_s"] == pytest.approx(0.5)
    assert s["tpot_s"]["p99"] == pytest.approx(np.percentile([0.1, 0.1, 0.5], 99))
    assert percentiles([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    assert percentiles([1, 2, 3, 4])["p50"] == 2.5


def test_arrivals_are_seeded_and_average_the_rate():
    a = arrival_times(2000, rate=4.0, seed=3)
    assert a == arrival_times(2000, rate=4.0, seed=3) and a[0] == 0.0 and a == sorted(a)
    assert 2000 / a[-1] == pytest.approx(4.0, rel=0.06)
    gaps = np.diff(arrival_times(4000, rate=4.0, burstiness=0.25, seed=1))
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.15)   # gamma shape 0.25: CV = 1/sqrt(0.25)
    assert arrival_times(3, rate=0) == [0.0, 0.0, 0.0]


def test_traces_scale_lengths_and_mooncake_blocks_share_tokens():
    azure = workloads.trace(TRACES / "azure_conv_2023.csv", scale=16, limit=3)
    assert [len(r.prompt) for r in azure] == [round(374 / 16), round(396 / 16), round(879 / 16)]
    assert [r.max_tokens for r in azure[:2]] == [round(44 / 16), round(109 / 16)]
    assert azure[0].at == 0 and azure[1].at == pytest.approx(4.314579, abs=1e-5)
    moon = workloads.trace(TRACES / "mooncake_conversation.jsonl.gz", scale=16, limit=3)
    assert [len(r.prompt) for r in moon] == [round(6758 / 16), round(7322 / 16), round(7236 / 16)]
    assert moon[0].prompt[:32] == moon[1].prompt[:32] == moon[2].prompt[:32]   # hash id 0: one 32-token block
    assert moon[0].prompt[32:64] != moon[1].prompt[32:64]


def test_victims_and_aggressors_mix():
    reqs = workloads.victims_and_aggressors(200, seed=1)
    victims = [r for r in reqs if r.kind == "victim"]
    aggressors = [r for r in reqs if r.kind == "aggressor"]
    assert {len(r.prompt) for r in victims} == {32} and {r.max_tokens for r in victims} == {128}
    assert {len(r.prompt) for r in aggressors} == {1024} and {r.max_tokens for r in aggressors} == {4}
    assert 40 <= len(victims) <= 70 and 5 <= len(aggressors) <= 15 and all(r.at < 200 for r in reqs)
    assert [r.at for r in reqs] == sorted(r.at for r in reqs)


def test_goodput_is_the_rate_where_attainment_crosses_the_target():
    # met at 0.5 and 1.0, 0.95 → 0.75 between 1.0 and 2.0: crosses 0.9 a quarter of the way
    assert rate_at_attainment([(2.0, 0.75), (0.5, 1.0), (1.0, 0.95)]) == pytest.approx(1.25)
    assert rate_at_attainment([(0.5, 1.0), (1.0, 0.9)]) == 1.0                # met at every rate tried
    assert rate_at_attainment([(0.5, 1.0), (1.0, 0.5), (2.0, 0.95)]) == 0.6   # the first miss ends it
    assert rate_at_attainment([(1.0, 0.5), (2.0, 1.0)]) == 0.0                # missed at the lowest rate
