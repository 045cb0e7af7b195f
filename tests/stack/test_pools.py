"""Several workers per pool under concurrent load, and the colocated mode. On the fake model
(tests/stack/conftest.py), but for the native weights' test: what the others test is the path
(pools, placement, the KV deadline, the trace), each answer compared with the in-process fake's."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import FAKE, MODEL, fake_env
from helpers import generate

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.state import worker_key

pytestmark = pytest.mark.slow
QUESTIONS = [f"What is the capital of {c}?" for c in
             ["France", "Spain", "Italy", "Japan", "Peru", "Kenya", "Canada", "Egypt", "Chile", "Norway"]] + \
            [f"Give one fact about the number {n}." for n in range(10)]


def _expected(loaded, max_tokens: int) -> dict[str, list[int]]:
    tok = loaded.tokenizer
    prompts = {q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS}
    return generate(loaded, prompts, SamplingParams(max_tokens=max_tokens, temperature=0))


async def _ask_all(url: str, max_tokens: int) -> dict[str, dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        async def one(q):
            r = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": q}], "temperature": 0,
                "max_tokens": max_tokens, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return q, r.json()
        return dict(await asyncio.gather(*(one(q) for q in QUESTIONS)))


def test_two_prefill_two_decode_serve_20_concurrent_requests(fake, tmp_path):
    cfg = StackConfig.on_free_ports(prefill=2, decode=2, kv_blocks=512, threads=1, log_dir=tmp_path, model=FAKE,
                                    env=fake_env())
    with Stack(cfg) as stack:
        answers = asyncio.run(_ask_all(stack.url, 12))
        ready = httpx.get(stack.metrics_url("gateway", "/ready")).json()
    expected = _expected(fake, 12)
    for q in QUESTIONS:
        assert answers[q]["choices"][0]["token_ids"] == expected[q], q
    assert ready["workers"] == {"router": 1, "prefill": 2, "decode": 2}


def test_native_weights_in_both_pools_give_each_requests_tokens_as_if_alone(smollm2_native, tmp_path):
    """PD_WEIGHTS=native on both pools: 20 concurrent requests, prefilled on the prefill worker or
    beside the decode worker's streams and decoded in batches of whatever is running, each get
    the tokens the in-process native engine gives it alone (a row's sums do not depend on its
    batch, and a decode pass in one C call equals the layer-by-layer path)."""
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, log_dir=tmp_path,
                                    env={"PD_WEIGHTS": "native"})
    with Stack(cfg) as stack:
        answers = asyncio.run(_ask_all(stack.url, 12))
    native, tok = smollm2_native, smollm2_native.tokenizer
    for q in QUESTIONS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
        alone = generate(native, {q: ids}, SamplingParams(max_tokens=12, temperature=0))[q]
        assert answers[q]["choices"][0]["token_ids"] == alone, q


def test_colocated_mode_serves_without_a_prefill_pool(fake, tmp_path, otlp):
    """No prefill pool: the decode worker prefills; the answer is the in-process engine's. Its
    trace is the local-prefill path: the route says local, decode.generate has no KV transfer
    under it, no prefill span exists."""
    cfg = StackConfig.on_free_ports(decode=1, colocated=True, kv_blocks=512, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(OTEL_EXPORTER_OTLP_ENDPOINT=otlp.url))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = fake.tokenizer
    expected = generate(fake, {"q": tok.encode(tok.apply_chat_template(messages))},
                        SamplingParams(max_tokens=16, temperature=0))["q"]
    with Stack(cfg) as stack:
        r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 16, "return_token_ids": True})
        ready = httpx.get(stack.metrics_url("gateway", "/ready")).json()
        spans = otlp.wait_for(r.headers["x-trace-id"], {"gateway.request", "router.route", "decode.admit",
                                                        "decode.generate"})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(expected)
    assert ready["ready"] and ready["workers"]["prefill"] == 0
    by_name = {s.name: s for s in spans}
    by_id = {s.span_id: s for s in spans}
    route, generate_ = by_name["router.route"], by_name["decode.generate"]
    assert route.attributes["mode"] == "local" and route.attributes["decode_worker"] == "decode-0"
    assert by_id[route.parent_id].service == "pdserve-gateway"
    assert generate_.parent_id == route.span_id and by_name["decode.admit"].parent_id == route.span_id
    assert generate_.attributes["mode"] == "local" and generate_.attributes["output_tokens"] == len(
        r.json()["choices"][0]["token_ids"])
    assert any(name == "first_token" for name, _ in generate_.events)
    assert not {"kv.receive", "kv.transfer", "prefill.compute", "prefill.queue"} & set(by_name)


def test_a_stalled_prefill_worker_costs_a_deadline_not_the_request(fake, tmp_path):
    """Prefill frozen mid-flight: the decode worker's KV deadline passes, it prefills locally,
    the answer is the same; when the prefill worker wakes, its late KV is refused and freed."""
    import json
    import signal

    import redis

    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(PD_KV_TIMEOUT_S="2"))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = fake.tokenizer
    expected = generate(fake, {"q": tok.encode(tok.apply_chat_template(messages))},
                        SamplingParams(max_tokens=12, temperature=0))["q"]
    with Stack(cfg) as stack:
        prefill = stack.procs["prefill-0"]
        prefill.send_signal(signal.SIGSTOP)
        try:
            r = httpx.post(stack.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12,
                "return_token_ids": True})
        finally:
            prefill.send_signal(signal.SIGCONT)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected
        store = redis.Redis.from_url(stack.redis_url)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            infos = [json.loads(store.get(k)) for k in store.keys(worker_key("*"))]
            workers = [w for w in infos if w["role"] in ("prefill", "decode")]
            if len(workers) == 2 and all(w["free_blocks"] == w["total_blocks"] for w in workers):
                break
            time.sleep(0.5)
        assert len(workers) == 2 and all(w["free_blocks"] == w["total_blocks"] for w in workers), workers
