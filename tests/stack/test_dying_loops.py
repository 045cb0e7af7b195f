"""A worker whose engine loop dies leaves the registry at once and exits non-zero, instead of
heartbeating on while it does nothing; its streams are continued on another decode worker,
each one exactly the in-process engine's tokens. On the fake model (tests/stack/conftest.py):
what is tested is the loop's death and the streams' failover, not the model's numbers."""

from __future__ import annotations

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
