"""Client-side latency metrics from scripted chunk timings (exact values), and a worker's
gauges from its registry entry."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from pdserve.services.gateway import timing
from pdserve.shared import metrics
from pdserve.shared.messages import TokenChunk, WorkerInfo


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_ttft_itl_tpot_and_e2e_from_scripted_timings():
    clock = iter([1.0, 1.1, 1.3])   # the monotonic times the three chunks arrive
    chunks = [TokenChunk(request_id="r", seq=0, token_ids=[5], text="a"),
              TokenChunk(request_id="r", seq=1, token_ids=[6], text="b"),
              TokenChunk(request_id="r", seq=2, token_ids=[7, 8], text="cd", finished=True, finish_reason="stop")]

    async def source():
        for c in chunks:
            yield c

    before = {m: (value(f"{m}_sum", mode="unit"), value(f"{m}_count", mode="unit")) for m in (
        "pd_time_to_first_token_seconds", "pd_inter_token_latency_seconds", "pd_time_per_output_token_seconds",
        "pd_e2e_request_latency_seconds")}

    async def run():
        return [c async for c in timing.timed(source(), arrived=0.5, mode="unit", trace_id="ab" * 16,
                                                   clock=lambda: next(clock))]

    assert asyncio.run(run()) == chunks
    got = {m: (value(f"{m}_sum", mode="unit") - s, value(f"{m}_count", mode="unit") - n)
           for m, (s, n) in before.items()}
    assert got["pd_time_to_first_token_seconds"] == pytest.approx((0.5, 1))
    assert got["pd_inter_token_latency_seconds"] == pytest.approx((0.1 + 0.2, 2))
    assert got["pd_e2e_request_latency_seconds"] == pytest.approx((0.8, 1))
    assert got["pd_time_per_output_token_seconds"] == pytest.approx(((1.3 - 1.0) / 3, 1))   # 4 tokens, 3 gaps


def test_worker_gauges_follow_the_registry_entry():
    metrics.worker(WorkerInfo(worker_id="d", role="decode", total_blocks=100, free_blocks=70, running=3, waiting=2,
                              queued_tokens=512))
    assert value("pd_kv_blocks", role="decode", state="used") == 30
    assert value("pd_kv_blocks", role="decode", state="free") == 70
    assert value("pd_sequences", role="decode", state="waiting") == 2
    assert value("pd_queued_prompt_tokens", role="decode") == 512
