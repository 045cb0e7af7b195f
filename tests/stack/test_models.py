"""Other architectures through the disaggregated stack (`make run RUN_ARGS="--model DIR"`): tiny
random Qwen3 and Gemma 3 checkpoints (bench/tiny_archs.py) served under their own names, every
prompt prefilled in the prefill pool and decoded after the KV handoff, each request's greedy
tokens equal to transformers' for it."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench import tiny_archs
from bench.engine_quality import reference_greedy
from deploy.local.stack import Stack, StackConfig
from shared.engine.loader import load

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain. " * 6, "What is 17 times 3?"]


def _received_kv_bytes(stack: Stack) -> float:
    text = httpx.get(stack.metrics_url("decode-0"), timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pd_kv_received_bytes_total")


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_a_tiny_checkpoint_served_through_the_handoff_equals_transformers(name, tmp_path):
    path = tiny_archs.save(name, tmp_path, tokenizer=True)
    tok = load(str(path)).tokenizer
    assert tok is not None
    prompts = {q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS}
    hf = tiny_archs.build(name)
    expected = {q: reference_greedy(hf, ids, 10) for q, ids in prompts.items()}
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=256, threads=1, model=str(path),
                                    log_dir=tmp_path / "logs", env={"PD_PREFILL_MODE": "remote"})
    with Stack(cfg) as stack:
        models = httpx.get(stack.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [name]  # the directory's name
        for q in QUESTIONS:
            r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
                "model": name, "messages": [{"role": "user", "content": q}], "temperature": 0,
                "max_tokens": 10, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected[q], q
        assert _received_kv_bytes(stack) > 0  # the prompts' KV came from the prefill pool
