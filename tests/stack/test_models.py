"""Other architectures through the disaggregated stack (`make run RUN_ARGS="--model DIR"`): a tiny
random checkpoint of each `model_type` (bench/engine/tiny_archs.py) served under its own name, and
the real Gemma 3 270M Q4_K_M file; every prompt prefilled in the prefill pool and decoded after
the KV handoff, each request's greedy tokens equal to transformers' (or the in-process engine's)."""

from __future__ import annotations

import httpx
import pytest
from helpers import generate

from bench.engine import tiny_archs
from bench.engine.quality import reference_greedy
from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.engine.loader import load
from pdserve.shared.engine.sequence import SamplingParams

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain. " * 6, "What is 17 times 3?"]


# one checkpoint per model_type (Llama's with Llama 3.1's RoPE)
ARCHS = ["llama3-rope", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"]


@pytest.mark.parametrize("name", ARCHS)
def test_a_tiny_checkpoint_served_through_the_handoff_equals_transformers(name, tmp_path):
    path = tiny_archs.save(name, tmp_path, tokenizer=True)
    tok = load(str(path)).tokenizer
    assert tok is not None
    prompts = {q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS}
    hf = tiny_archs.build(name)
    expected = {q: reference_greedy(hf, ids, 10) for q, ids in prompts.items()}
    template = tmp_path / "tools.jinja"  # the operator's template, which reads tools (Llama's: its call format)
    template.write_text(tiny_archs.LLAMA3_TOOLS if name.startswith("llama") else tiny_archs.CHATML_TOOLS)
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=256, threads=1, model=str(path),
                                    log_dir=tmp_path / "logs", env={"PD_PLACEMENT": "remote",
                                                                    "PD_CHAT_TEMPLATE": str(template)})
    with Stack(cfg) as stack:
        models = httpx.get(stack.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [name]  # the directory's name
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
            "model": name, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 4,
            "tools": [tool]})
        assert r.status_code == 200, r.text
        tok.chat_template = template.read_text()
        listed = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], tools=[tool])
        assert "Tools: get_weather" in listed and r.json()["usage"]["prompt_tokens"] == len(tok.encode(listed))
        city = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
        r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
            "model": name, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 200,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": city}}],
            "tool_choice": "required", "parallel_tool_calls": False})
        choice = r.json()["choices"][0]  # the call as the model wrote it in its format, taken out of the text
        assert choice["finish_reason"] == "tool_calls", choice
        assert [c["function"] for c in choice["message"]["tool_calls"]] == \
            [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
        fmt = "llama3_json" if name.startswith("llama") else "hermes"
        assert f"tool calls in the {fmt} format" in (tmp_path / "logs" / "gateway.log").read_text()
        for q in QUESTIONS:
            r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
                "model": name, "messages": [{"role": "user", "content": q}], "temperature": 0,
                "max_tokens": 10, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected[q], q
        assert stack.metric_total("decode-0", "pd_kv_received_bytes_total") > 0  # the KV came from prefill


def test_gemma3_270m_q4_k_m_served_end_to_end(gemma3, tmp_path):
    """The real Gemma 3 270M file through the handoff: completions (the base model has no chat
    template), each request's tokens the in-process engine's for it."""
    gemma = gemma3
    texts = ["The capital of France is", "def fibonacci(n):\n    "]
    assert gemma.tokenizer is not None
    expected = generate(gemma, {t: gemma.tokenizer.encode(t) for t in texts},
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=256, threads=1, model="gemma3-270m",
                                    log_dir=tmp_path, env={"PD_PLACEMENT": "remote"})
    with Stack(cfg) as stack:
        for t in texts:
            r = httpx.post(stack.url + "/v1/completions", timeout=120, json={
                "model": "gemma-3-270m", "prompt": t, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected[t], t
        assert stack.metric_total("decode-0", "pd_kv_received_bytes_total") > 0
