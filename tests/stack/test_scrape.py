"""Every service's /metrics after a few requests: latency histograms counted, exemplars that
are the requests' trace ids, and KV transfer counters equal to the bytes the transfers
reported on their spans (sent on the prefill side, received on the decode side).
On the session's fake-model stack (tests/stack/conftest.py): what is tested is the metrics against
the spans, not the model's numbers."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import MODEL
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
SERVICES = ("gateway", "router", "prefill-0", "decode-0")


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


@pytest.fixture(scope="module")
def client(fake_client):
    return fake_client


def scrape(stack, name: str) -> dict[tuple, float]:
    text = httpx.get(stack.metrics_url(name), timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict[tuple, float], name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_histograms_count_requests_and_transfer_counters_match_the_spans(stack, client, otlp):
    before = {name: scrape(stack, name) for name in SERVICES}
    traces = []
    for i in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i + 3} in words."}], temperature=0,
            max_tokens=6, extra_body={"ignore_eos": True})
        traces.append(raw.headers["x-trace-id"])
    sent = 0
    for trace_id in traces:
        spans = {s.name: s for s in otlp.wait_for(trace_id, {"kv.transfer", "kv.receive"})}
        assert spans["kv.transfer"].attributes["acked"] is True
        sent += spans["kv.transfer"].attributes["bytes"]
    deadline = time.monotonic() + 5   # counters move when each handoff ends, spans with them
    while True:
        after = {name: scrape(stack, name) for name in SERVICES}
        def delta(svc, metric, after=after, **kw):
            return total(after[svc], metric, **kw) - total(before[svc], metric, **kw)
        if delta("prefill-0", "pd_kv_transfer_bytes_total") >= sent or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sent > 0
    assert delta("prefill-0", "pd_kv_transfer_bytes_total", transport="segment") == sent   # one host
    assert delta("decode-0", "pd_kv_received_bytes_total") == sent
    assert delta("prefill-0", "pd_kv_transfer_seconds_count") == 3
    assert delta("prefill-0", "pd_kv_transfer_failures_total") == 0
    for metric in ("pd_time_to_first_token_seconds_count", "pd_e2e_request_latency_seconds_count",
                   "pd_time_per_output_token_seconds_count"):
        assert delta("gateway", metric, mode="remote") == 3, metric
    assert delta("gateway", "pd_inter_token_latency_seconds_count", mode="remote") == 3 * 5   # 6 tokens: 5 gaps
    assert delta("gateway", "pd_requests_total", outcome="finished") == 3
    assert delta("gateway", "pd_output_tokens_total") == 18
    assert delta("router", "pd_placements_total", mode="remote") == 3
    assert delta("prefill-0", "pd_prompt_tokens_total", role="prefill") > 0
    assert delta("decode-0", "pd_engine_step_seconds_count", role="decode", kind="decode") >= 3 * 5
    assert total(after["decode-0"], "pd_kv_blocks", role="decode") == stack.cfg.kv_blocks   # free + used = the pool
    # under vLLM's names too (pdserve/shared/metrics_vllm.py), with the model's name
    assert delta("gateway", "vllm:time_to_first_token_seconds_count", model_name=MODEL) == 3
    assert delta("gateway", "vllm:generation_tokens_total", model_name=MODEL) == 18
    assert 0 <= total(after["decode-0"], "vllm:kv_cache_usage_perc", model_name=MODEL) <= 1
    assert ("vllm:num_requests_running", (("model_name", MODEL), ("role", "decode"))) in after["decode-0"]
    assert delta("gateway", "vllm:request_success_total", model_name=MODEL, finished_reason="length") == 3
    assert delta("gateway", "vllm:request_generation_tokens_sum", model_name=MODEL) == 18
    assert delta("gateway", "vllm:request_decode_time_seconds_count", model_name=MODEL) == 3
    assert delta("prefill-0", "vllm:request_queue_time_seconds_count", model_name=MODEL) == 3
    assert delta("prefill-0", "vllm:request_prefill_time_seconds_count", model_name=MODEL) == 3
    # OpenMetrics (what Prometheus asks for) carries the trace ids as exemplars
    om = httpx.get(stack.metrics_url("gateway"), headers={"accept": "application/openmetrics-text"}).text
    ttft_lines = [ln for ln in om.splitlines() if ln.startswith("pd_time_to_first_token_seconds_bucket")]
    assert any(f'trace_id="{traces[-1]}"' in ln for ln in ttft_lines), ttft_lines[:3]
