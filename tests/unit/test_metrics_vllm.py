"""The metrics under vLLM's names (pdserve/shared/metrics_vllm.py): what a vLLM dashboard or an llm-d
scorer queries is exported, with `model_name`, and equals the pd_* metric it views."""

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from pdserve.shared import metrics
from pdserve.shared.metrics_vllm import VllmNames

# the series vLLM's Grafana dashboard, llm-d's scorers and KEDA recipes query
QUERIED = ["vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
           "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
           "vllm:request_time_per_output_token_seconds_sum", "vllm:num_requests_running", "vllm:num_requests_waiting",
           "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
           "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]


# every series vLLM's own example dashboard queries (vllm-project/vllm,
# examples/online_serving/prometheus_grafana/grafana.json at e88892c9080b29aa3dbc1d1096ba719ab0886163)
DASHBOARD = ["vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
             "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
             "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_swapped",
             "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
             "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
             "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
             "vllm:request_generation_tokens_bucket", "vllm:request_success_total",
             "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
             "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum"]
# vLLM V0's, dropped by vLLM V1 too: a swap tier pdserve does not have, V0's sequence groups
NOT_EXPORTED = {"vllm:num_requests_swapped", "vllm:cpu_cache_usage_perc", "vllm:request_max_num_generation_tokens_sum"}


def samples(registry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_vllms_names_view_the_pd_metrics_with_the_model_name():
    metrics.TTFT.labels("remote").observe(0.2)
    metrics.E2E.labels("remote").observe(1.0)
    metrics.ITL.labels("remote").observe(0.02)
    metrics.TPOT.labels("remote").observe(0.02)
    metrics.OUTPUT_TOKENS.inc(5)
    metrics.PROMPT_TOKENS.labels("decode").inc(40)
    metrics.CACHED_TOKENS.labels("decode").inc(16)
    metrics.SEQUENCES.labels("decode", "running").set(3)
    metrics.SEQUENCES.labels("decode", "waiting").set(2)
    metrics.KV_BLOCKS.labels("decode", "used").set(25)
    metrics.KV_BLOCKS.labels("decode", "free").set(75)
    metrics.DECODE_SECONDS.labels("remote").observe(0.8)
    metrics.FINISHED.labels("length").inc()
    metrics.REQUEST_PROMPT_TOKENS.observe(40)
    metrics.REQUEST_OUTPUT_TOKENS.observe(5)
    metrics.PREFILL_QUEUE_SECONDS.observe(0.01)
    metrics.PREFILL_SECONDS.observe(0.1)
    views = CollectorRegistry()
    views.register(VllmNames("SmolLM2"))
    got, pd = samples(views), samples(metrics.REGISTRY)
    names = {name for name, _ in got}
    assert set(QUERIED) <= names
    assert sorted(set(DASHBOARD) - NOT_EXPORTED - names) == []  # each of vLLM's dashboard panels has its series
    assert got[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "SmolLM2")))] >= 1
    assert all(dict(labels)["model_name"] == "SmolLM2" for _, labels in got)
    assert got[("vllm:num_requests_running", (("model_name", "SmolLM2"), ("role", "decode")))] == 3
    assert got[("vllm:kv_cache_usage_perc", (("model_name", "SmolLM2"), ("role", "decode")))] == 0.25
    assert got[("vllm:generation_tokens_total", (("model_name", "SmolLM2"),))] == pd[("pd_output_tokens_total", ())]
    assert got[("vllm:prefix_cache_hits_total", (("model_name", "SmolLM2"), ("role", "decode")))] == \
        pd[("pd_prefix_cache_hit_tokens_total", (("role", "decode"),))]
    ttft = [(labels, v) for (n, labels), v in got.items() if n == "vllm:time_to_first_token_seconds_bucket"]
    assert ttft and all(v == pd[("pd_time_to_first_token_seconds_bucket",
                                  tuple(kv for kv in labels if kv[0] != "model_name"))] for labels, v in ttft)


def test_a_prometheus_scrape_gets_vllms_names_as_they_are():
    """Prometheus asks for OpenMetrics (Accept below: Prometheus 2.x's); without an escaping of
    its own prometheus_client escapes the `:` of every sample's name, so `vllm:...` reached
    Prometheus as `vllm_...` (seen by make compose-check). The gateway's /metrics and the
    workers' ask it to keep names as they are."""
    registry = CollectorRegistry()
    Counter("vllm:generation_tokens", "tokens", registry=registry).inc(3)
    accept = "application/openmetrics-text;version=1.0.0;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    encode, content_type = choose_encoder(metrics.openmetrics_names_kept(accept))
    assert content_type.startswith("application/openmetrics-text")
    names = {s.name for f in openmetrics_families(encode(registry).decode()) for s in f.samples}
    assert "vllm:generation_tokens_total" in names and "vllm_generation_tokens_total" not in names
    assert metrics.openmetrics_names_kept("text/plain") == "text/plain"
