"""The gateway's guards on the live stack: API keys (401), the per-key rate (429 +
Retry-After), prompt and max_tokens limits (400 naming the limit); and neither the key, the
prompt nor the bus passwords appear in any service's log. On the fake model (tests/stack/conftest.py):
what is tested is the gateway's guards and the per-key prefix caches, not the model's numbers."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest
from conftest import FAKE, MODEL, fake_env

from pdserve.local.stack import Stack, StackConfig
from pdserve.services.gateway.auth import hash_key

pytestmark = pytest.mark.slow
KEY = "pd-" + "k3y" * 12
SECRET_PROMPT = "The vault code is 7-4-1-9; tell nobody."


def test_keys_rate_limit_and_length_limits_on_the_live_gateway(tmp_path):
    cfg = StackConfig.on_free_ports(colocated=True, decode=1, kv_blocks=256, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(PD_API_KEYS=f"tester:{hash_key(KEY)}", PD_RATE_LIMIT_PER_S="0.1",
                                                 PD_RATE_LIMIT_BURST="4", PD_MAX_PROMPT_TOKENS="64",
                                                 PD_MAX_TOKENS_LIMIT="8"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 4}

    with Stack(cfg) as stack:
        def post(payload, key=KEY):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.post(stack.url + "/v1/chat/completions", json=payload, headers=headers, timeout=60)

        missing, wrong = post(body, key=None), post(body, key="pd-wrong")
        models = httpx.get(stack.url + "/v1/models", timeout=10)
        health = httpx.get(stack.metrics_url("gateway", "/health"), timeout=10)
        good = post(body)                                                       # 1 of the burst of 4
        long = post({**body, "messages": [{"role": "user", "content": "word " * 100}]})      # 2
        big = post({**body, "max_tokens": 100})                                  # 3
        again = post(body)                                                       # 4
        over = post(body)                                                        # the bucket is empty
        passwords = [stack.secret, *stack.ids.passwords()]
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))

    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "missing_api_key")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (401, "invalid_api_key")
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert models.status_code == 401 and health.status_code == 200
    assert good.status_code == 200 and again.status_code == 200, (good.text, again.text)
    assert long.status_code == 400 and long.json()["error"]["code"] == "prompt_too_long"
    assert "at most 64 prompt tokens" in long.json()["error"]["message"]
    assert big.status_code == 400 and big.json()["error"]["param"] == "max_tokens"
    assert "at most 8" in big.json()["error"]["message"]
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(over.headers["retry-after"]) <= 10
    assert "1 API keys configured" in logs
    for leak in (KEY, SECRET_PROMPT, "vault code", *passwords):
        assert leak not in logs, leak


def test_tenants_share_no_cached_prefix_and_get_their_fair_share(tmp_path):
    """Key B's request gets no cached tokens from key A's identical prompt (each key's prefix
    cache is its own, PD_PREFIX_CACHE_PER_KEY), while each key's own repeat hits; a request's
    `cache_salt` partitions further within a key. A priority ahead of the default is only for
    the keys allowed it; a request's tokens (prompt + n x max_tokens) come from its key's token
    bucket; a key has at most PD_MAX_CONCURRENT_PER_KEY requests in flight, and a stream the
    client closes frees its place. (The fake at 20 ms a pass: a 1,000-token stream stays open.)"""
    other = "pd-" + "0th3r" * 8
    cfg = StackConfig.on_free_ports(colocated=True, decode=1, kv_blocks=256, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(0.02, PD_API_KEYS=f"alice:{hash_key(KEY)},bob:{hash_key(other)}",
                                                 PD_PRIORITY_KEYS="alice", PD_TOKEN_RATE_LIMIT_PER_S="1",
                                                 PD_TOKEN_RATE_LIMIT_BURST="5000", PD_MAX_CONCURRENT_PER_KEY="2"))
    document = " ".join(f"Line {i}: the pump on deck {i % 5} ran {i * 3} hours." for i in range(20))
    body = {"model": MODEL, "messages": [{"role": "user", "content": document}], "max_tokens": 2}

    with Stack(cfg) as stack:
        def post(key: str, **extra) -> httpx.Response:
            return httpx.post(stack.url + "/v1/chat/completions", json={**body, **extra}, timeout=60,
                              headers={"Authorization": f"Bearer {key}"})

        def cached(key: str, **extra) -> int:
            r = post(key, **extra)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        alice = [cached(KEY), cached(KEY)]
        bob = [cached(other), cached(other)]
        salted = [cached(KEY, cache_salt="s1"), cached(KEY, cache_salt="s1")]
        ahead = [post(KEY, priority=-5).status_code, post(other, priority=-5)]
        heavy = post(KEY, n=2, max_tokens=1700)  # 2 x 1,700 tokens and the prompt: more than alice has left
        wide = post(KEY, n=3)  # more choices than alice may have in flight
        short = {"messages": [{"role": "user", "content": "Count to fifty."}], "max_tokens": 2}
        with httpx.Client(timeout=60) as client, ExitStack() as held:
            streams = []  # alice's two places, taken by streams (1,000 tokens each: open for seconds)
            for _ in range(2):
                r = held.enter_context(client.stream("POST", stack.url + "/v1/chat/completions", json={
                    **body, **short, "max_tokens": 1000, "ignore_eos": True, "stream": True},
                    headers={"Authorization": f"Bearer {KEY}"}))
                streams.append(r.iter_lines())  # (kept: a line iterator let go closes its connection)
                assert r.status_code == 200 and next(streams[-1]).startswith("data:")
            third, bob_meanwhile = post(KEY, **short), post(other, **short)
        freed = next((r for r in (post(KEY, **short) for _ in range(50))
                      if r.status_code != 429 or time.sleep(0.1)), None)  # the closed streams' places
    assert alice[0] == 0 and alice[1] > 0
    assert bob[0] == 0 and bob[1] > 0  # nothing from alice's identical prompt
    assert salted[0] == 0 and salted[1] > 0
    assert ahead[0] == 200 and ahead[1].status_code == 400 and ahead[1].json()["error"]["param"] == "priority"
    assert heavy.status_code == 429 and "tokens/s" in heavy.json()["error"]["message"], heavy.text
    assert wide.status_code == 400 and wide.json()["error"]["param"] == "n"
    assert third.status_code == 429 and third.json()["error"]["code"] == "concurrency_limit_exceeded", third.text
    assert bob_meanwhile.status_code == 200 and freed is not None and freed.status_code == 200
