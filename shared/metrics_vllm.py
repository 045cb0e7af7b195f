"""The metrics under vLLM's names too, for the dashboards, autoscalers and routers that read
them (vLLM's Grafana dashboard, llm-d's scorers, KEDA and Prometheus-Adapter recipes): each a
view of a `pd_*` metric (shared/metrics.py) taken at scrape time, with vLLM's `model_name`
label beside the metric's own. Nothing is counted twice.

    vllm:time_to_first_token_seconds          pd_time_to_first_token_seconds       gateway
    vllm:inter_token_latency_seconds          pd_inter_token_latency_seconds       gateway
    vllm:request_time_per_output_token_seconds pd_time_per_output_token_seconds    gateway
    vllm:e2e_request_latency_seconds          pd_e2e_request_latency_seconds       gateway
    vllm:generation_tokens_total              pd_output_tokens_total               gateway
    vllm:prompt_tokens_total                  pd_prompt_tokens_total               workers
    vllm:prefix_cache_queries_total           pd_prompt_tokens_total (tokens)      workers
    vllm:prefix_cache_hits_total              pd_prefix_cache_hit_tokens_total     workers
    vllm:num_requests_running / _waiting      pd_sequences{state}                  workers
    vllm:kv_cache_usage_perc                  pd_kv_blocks used / all (0-1)        workers
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric

from shared import metrics

RENAMED = {  # (a pd_* metric, its vLLM name)
    metrics.TTFT: "vllm:time_to_first_token_seconds",
    metrics.ITL: "vllm:inter_token_latency_seconds",
    metrics.TPOT: "vllm:request_time_per_output_token_seconds",
    metrics.E2E: "vllm:e2e_request_latency_seconds",
    metrics.OUTPUT_TOKENS: "vllm:generation_tokens",
    metrics.PROMPT_TOKENS: "vllm:prompt_tokens",
    metrics.CACHED_TOKENS: "vllm:prefix_cache_hits",
}
QUERIES = (metrics.PROMPT_TOKENS, "vllm:prefix_cache_queries")  # the tokens looked up in the prefix cache
NAMES = (*RENAMED.values(), QUERIES[1], "vllm:num_requests_running", "vllm:num_requests_waiting",
         "vllm:kv_cache_usage_perc")


class VllmNames:
    """A collector: the views above, for the model `model_name`."""

    def __init__(self, model_name: str):
        self.model = model_name

    def collect(self) -> Iterator[Metric]:
        for source, name in [*RENAMED.items(), QUERIES]:
            for family in source.collect():
                if family.samples:
                    yield self._renamed(family, name)
        yield from self._engine()

    def _renamed(self, family: Metric, name: str) -> Metric:
        out = Metric(name, family.documentation, family.type)
        for s in family.samples:
            out.add_sample(name + s.name[len(family.name):], {**s.labels, "model_name": self.model}, s.value,
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
        usage = Metric("vllm:kv_cache_usage_perc", "KV cache blocks in use (0-1)", "gauge")
        for role in sorted({role for role, _ in blocks}):
            used, free = blocks.get((role, "used"), 0.0), blocks.get((role, "free"), 0.0)
            usage.add_sample(usage.name, {"role": role, "model_name": self.model}, used / (used + free or 1.0))
        if usage.samples:
            yield usage


def _by_role_state(gauge) -> dict[tuple[str, str], float]:
    return {(s.labels["role"], s.labels["state"]): s.value for f in gauge.collect() for s in f.samples}


_registered: list[VllmNames] = []


def register(model_name: str) -> None:
    """Export the views from this process's registry (once a process)."""
    if not _registered:
        _registered.append(VllmNames(model_name))
        REGISTRY.register(_registered[0])
