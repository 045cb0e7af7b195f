"""Prefix-aware placement on the live stack: prompts that share a long system prompt go to
the prefill worker that already holds it, and reuse its KV."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import MODEL
from deploy.local.stack import Stack, StackConfig

pytestmark = pytest.mark.slow
SYSTEM = "You are the archive assistant of the river town of Alder. " + " ".join(
    f"Record {i}: the {c} mill ground {i * 13} sacks in week {i}." for i, c in
    enumerate(["north", "south", "east", "west", "old", "new"] * 5))


def _ask(url: str, messages, max_tokens=4) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "temperature": 0, "max_tokens": max_tokens, "messages": messages})
    assert r.status_code == 200, r.text
    return r


def test_shared_system_prompts_stay_on_the_worker_that_caches_them(otlp, tmp_path):
    """prefill-0 is busy with another long prompt when the first system-prompt request comes,
    so that one goes to prefill-1; every later one follows its cache there, though both
    workers are idle by then (a least-loaded or round-robin choice would not)."""
    cfg = StackConfig.on_free_ports(prefill=2, decode=1, kv_blocks=1024, log_dir=tmp_path,
                                    env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "PD_HEARTBEAT_S": "0.3"})
    traces = []
    other = [{"role": "user", "content": SYSTEM.replace("Alder", "Birch") + " Summarize."}]
    with Stack(cfg) as stack, ThreadPoolExecutor(1) as pool:
        busy = pool.submit(_ask, stack.url, other, 1)
        time.sleep(0.5)
        for q in ["Which mill ground the most?", "What happened in week 3?", "Name the mills.",
                  "How many records are there?"]:
            r = _ask(stack.url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            traces.append((r.headers["x-trace-id"], r.json()["usage"]["prompt_tokens"]))
            busy.result()
    spans = []
    for trace_id, _ in traces:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not {"router.route", "prefill.compute"} <= \
                {s.name for s in otlp.trace(trace_id)}:
            time.sleep(0.2)
        spans.append({s.name: s.attributes for s in otlp.trace(trace_id)})
    workers = [s["router.route"]["prefill_worker"] for s in spans]
    assert workers == ["prefill-1"] * 4, workers
    system_tokens = traces[0][1] - 20                        # all but the question's few tokens
    for s in spans[1:]:
        assert s["router.route"]["prefill_cached_tokens"] >= system_tokens // 16 * 16 - 16, s["router.route"]
        assert s["prefill.compute"]["cached_tokens"] == s["router.route"]["prefill_cached_tokens"]
