"""The metrics under vLLM's names (shared/metrics_vllm.py): what a vLLM dashboard or an llm-d
scorer queries is exported, with `model_name`, and equals the pd_* metric it views."""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared import metrics
from shared.metrics_vllm import VllmNames

# the series vLLM's Grafana dashboard, llm-d's scorers and KEDA recipes query
QUERIED = ["vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
           "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
           "vllm:request_time_per_output_token_seconds_sum", "vllm:num_requests_running", "vllm:num_requests_waiting",
           "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
           "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]


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
    views = CollectorRegistry()
    views.register(VllmNames("SmolLM2"))
    got, pd = samples(views), samples(metrics.REGISTRY)
    names = {name for name, _ in got}
    assert set(QUERIED) <= names
    assert all(dict(labels)["model_name"] == "SmolLM2" for _, labels in got)
    assert got[("vllm:num_requests_running", (("model_name", "SmolLM2"), ("role", "decode")))] == 3
    assert got[("vllm:kv_cache_usage_perc", (("model_name", "SmolLM2"), ("role", "decode")))] == 0.25
    assert got[("vllm:generation_tokens_total", (("model_name", "SmolLM2"),))] == pd[("pd_output_tokens_total", ())]
    assert got[("vllm:prefix_cache_hits_total", (("model_name", "SmolLM2"), ("role", "decode")))] == \
        pd[("pd_prefix_cache_hit_tokens_total", (("role", "decode"),))]
    ttft = [(labels, v) for (n, labels), v in got.items() if n == "vllm:time_to_first_token_seconds_bucket"]
    assert ttft and all(v == pd[("pd_time_to_first_token_seconds_bucket",
                                  tuple(kv for kv in labels if kv[0] != "model_name"))] for labels, v in ttft)
