"""The metrics under vLLM's names too, for the dashboards, autoscalers and routers that read
them (vLLM's Grafana dashboard, llm-d's scorers, KEDA and Prometheus-Adapter recipes): each a
view of a `pd_*` metric (pdserve/shared/metrics.py) taken at scrape time, with vLLM's `model_name`
label beside the metric's own. Nothing is counted twice.

    vllm:time_to_first_token_seconds          pd_time_to_first_token_seconds       gateway
    vllm:inter_token_latency_seconds          pd_inter_token_latency_seconds       gateway
    vllm:request_time_per_output_token_seconds pd_time_per_output_token_seconds    gateway
    vllm:e2e_request_latency_seconds          pd_e2e_request_latency_seconds       gateway
    vllm:generation_tokens_total              pd_output_tokens_total               gateway
    vllm:prompt_tokens_total                  pd_prompt_tokens_total               workers
    vllm:prefix_cache_queries_total           pd_prompt_tokens_total (tokens)      workers
    vllm:prefix_cache_hits_total              pd_prefix_cache_hit_tokens_total     workers
    vllm:time_per_output_token_seconds        pd_inter_token_latency_seconds       gateway (vLLM's older name)
    vllm:request_decode_time_seconds          pd_decode_seconds                    gateway
    vllm:request_success_total{finished_reason} pd_finished_requests               gateway
    vllm:request_prompt_tokens                pd_request_prompt_tokens             gateway
    vllm:request_generation_tokens            pd_request_output_tokens             gateway
    vllm:request_queue_time_seconds           pd_prefill_queue_seconds             prefill workers
    vllm:request_prefill_time_seconds         pd_prefill_seconds                   prefill workers
    vllm:num_requests_running / _waiting      pd_sequences{state}                  workers
    vllm:kv_cache_usage_perc                  pd_kv_blocks used / all (0-1)        workers
    vllm:gpu_cache_usage_perc                 the same (vLLM's older name)         workers

Not exported: vLLM V0's `vllm:cpu_cache_usage_perc` and `vllm:num_requests_swapped` (no swap
tier; vLLM V1 dropped them too) and `vllm:request_max_num_generation_tokens` (V0's sequence
groups).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Gauge
from prometheus_client.metrics_core import Metric

from pdserve.shared import metrics

RENAMED = {  # (a pd_* metric, its vLLM name)
    metrics.TTFT: "vllm:time_to_first_token_seconds",
    metrics.ITL: "vllm:inter_token_latency_seconds",
    metrics.TPOT: "vllm:request_time_per_output_token_seconds",
    metrics.E2E: "vllm:e2e_request_latency_seconds",
    metrics.OUTPUT_TOKENS: "vllm:generation_tokens",
    metrics.PROMPT_TOKENS: "vllm:prompt_tokens",
    metrics.CACHED_TOKENS: "vllm:prefix_cache_hits",
    metrics.DECODE_SECONDS: "vllm:request_decode_time_seconds",
    metrics.FINISHED: "vllm:request_success",
    metrics.REQUEST_PROMPT_TOKENS: "vllm:request_prompt_tokens",
    metrics.REQUEST_OUTPUT_TOKENS: "vllm:request_generation_tokens",
    metrics.PREFILL_QUEUE_SECONDS: "vllm:request_queue_time_seconds",
    metrics.PREFILL_SECONDS: "vllm:request_prefill_time_seconds",
}
LABELS = {"vllm:request_success": {"finish_reason": "finished_reason"}}  # (vLLM's label name)
ALSO = ((metrics.ITL, "vllm:time_per_output_token_seconds"),)  # a second name
QUERIES = (metrics.PROMPT_TOKENS, "vllm:prefix_cache_queries")  # the tokens looked up in the prefix cache
NAMES = (*RENAMED.values(), QUERIES[1], *(name for _, name in ALSO), "vllm:num_requests_running",
         "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


class VllmNames:
    """A collector: the views above, for the model `model_name`."""

    def __init__(self, model_name: str):
        self.model = model_name

    def collect(self) -> Iterator[Metric]:
        for source, name in [*RENAMED.items(), QUERIES, *ALSO]:
            for family in source.collect():
                if family.samples:
                    yield self._renamed(family, name)
        yield from self._engine()

    def _renamed(self, family: Metric, name: str) -> Metric:
        out = Metric(name, family.documentation, family.type)
        renames = LABELS.get(name, {})
        for s in family.samples:
            labels = {renames.get(k, k): v for k, v in s.labels.items()}
            out.add_sample(name + s.name[len(family.name):], {**labels, "model_name": self.model}, s.value,
                           s.timestamp, s.exemplar)
        return out

    def _engine(self) -> Iterator[Metric]:
        seqs, blocks = _by_role_state(metrics.SEQUENCES), _by_role_state(metrics.KV_BLOCKS)
        for state in ("running", "waiting"):
            gauge = Metric(f"vllm:num_requests_{state}", f"Sequences {state} in the engine", "gauge")
            for (role, st), value in seqs.items():
                if st == state:
                    gauge.add_sample(gauge.name, {"role": role, "model_name": self.model}, value)
            if gauge.samples:
                yield gauge
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            usage = Metric(name, "KV cache blocks in use (0-1)", "gauge")
            for role in sorted({role for role, _ in blocks}):
                used, free = blocks.get((role, "used"), 0.0), blocks.get((role, "free"), 0.0)
                usage.add_sample(name, {"role": role, "model_name": self.model}, used / (used + free or 1.0))
            if usage.samples:
                yield usage


def _by_role_state(gauge: Gauge) -> dict[tuple[str, str], float]:
    return {(s.labels["role"], s.labels["state"]): s.value for f in gauge.collect() for s in f.samples}


_registered: list[VllmNames] = []


def register(model_name: str) -> None:
    """Export the views from this process's registry (once a process)."""
    if not _registered:
        _registered.append(VllmNames(model_name))
        REGISTRY.register(_registered[0])
