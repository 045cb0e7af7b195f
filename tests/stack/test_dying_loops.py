"""A worker whose engine loop dies leaves the registry at once and exits non-zero, instead of
heartbeating on while it does nothing; its streams are continued on another decode worker,
each one exactly the in-process engine's tokens; a request that kills the workers it reaches
fails after two (pdserve/shared/quarantine.py). On the fake model (tests/stack/conftest.py):
what is tested is the loops' deaths and the streams' failover, not the model's numbers."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import FAKE, MODEL, fake_env
from helpers import generate

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.state import worker_key
from pdserve.shared.urls import sync_redis

pytestmark = pytest.mark.slow
QUESTIONS = ["Name three rivers of Europe.", "What is rain?", "Write a haiku about snow.", "Count to ten.",
             "What do bees make?", "Describe a lighthouse."]


def test_a_decode_worker_whose_engine_step_raises_leaves_and_its_streams_finish_elsewhere(fake, tmp_path):
    tok = fake.tokenizer
    prompts = {q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS}
    expected = generate(fake, prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    cfg = StackConfig.on_free_ports(prefill=1, decode=2, kv_blocks=512, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(PD_HEARTBEAT_S="0.3", PD_FAILOVER_CHECK_S="0.3"),
                                    worker_env={"decode-0": {"PD_FAULT_ENGINE_RAISE_AFTER_STEPS": "20"}})
    with Stack(cfg) as stack, httpx.Client(base_url=stack.url, timeout=120) as http:
        def ask(q: str) -> list[int]:
            r = http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 32,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            got = dict(zip(QUESTIONS, pool.map(ask, QUESTIONS)))
        victim = stack.procs["decode-0"]
        deadline = time.monotonic() + 10
        while victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        gone = sync_redis(stack.redis_url).get(worker_key("decode-0")) is None
        code = victim.poll()
    said = (tmp_path / "decode-0.log").read_text()
    assert code not in (None, 0), code  # it exited, and said it failed
    assert gone and "engine loop ended" in said and "leaving the registry" in said  # it left, not only lapsed
    assert got == expected


def test_a_request_that_crashes_two_workers_fails_with_an_error_while_the_others_are_served(fake, tmp_path):
    """PD_FAULT_CRASH_ON_PROMPT on every worker: a process dies in the first pass holding that text.
    The poison request kills the prefill worker (a router's requeue charges it the crash; no other
    prefill worker, so its decode worker prefills it), then that decode worker (the gateway charges
    the second crash): it ends with a 422 naming both, and is not placed on the last decode worker.
    A request decoding meanwhile and one sent after are served, each exactly the in-process engine's."""
    tok = fake.tokenizer
    asks = {q: [{"role": "user", "content": q}] for q in ("Describe a lighthouse.", "What do bees make?")}
    prompts = {q: tok.encode(tok.apply_chat_template(m)) for q, m in asks.items()}
    expected = generate(fake, prompts, SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
    cfg = StackConfig.on_free_ports(prefill=1, decode=2, kv_blocks=512, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(0.02, PD_HEARTBEAT_S="0.3", PD_FAILOVER_CHECK_S="0.3",
                                                 PD_PLACEMENT="remote", PD_FAULT_CRASH_ON_PROMPT="poison apple"))
    with Stack(cfg) as stack, httpx.Client(base_url=stack.url, timeout=120) as http, ThreadPoolExecutor(1) as pool:
        store = sync_redis(stack.redis_url)

        def ask(messages: list[dict], max_tokens: int = 150) -> httpx.Response:
            return http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                "return_token_ids": True})

        during = pool.submit(ask, asks["Describe a lighthouse."])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(  # until it decodes (its prompt left the prefill worker)
                json.loads(store.get(worker_key(w)) or "{}").get("running") for w in ("decode-0", "decode-1")):
            time.sleep(0.05)
        start = time.monotonic()
        poison = ask([{"role": "user", "content": "Tell me about the poison apple."}])
        failed_s = time.monotonic() - start
        after = ask(asks["What do bees make?"], 16)
        codes = {w: stack.procs[w].poll() for w in ("prefill-0", "decode-0", "decode-1")}
        during = during.result()
    assert poison.status_code == 422, poison.text
    error = poison.json()["error"]
    crashed = [w for w, code in codes.items() if code is not None]
    assert error["code"] == "request_quarantined" and "2 workers" in error["message"], error
    assert len(crashed) == 2 and "prefill-0" in crashed and all(w in error["message"] for w in crashed), codes
    for r, q, n in ((during, "Describe a lighthouse.", 150), (after, "What do bees make?", 16)):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected[q][:n]   # (greedy: a shorter one is its head)
    print(f"poison request failed {failed_s:.1f} s after it was sent; crashed {crashed}")
