"""The stack on a Redis Cluster of three primaries (PD_REDIS_URL=redis+cluster://, each service
instance its own ACL user on every node): concurrent requests get the tokens the in-process
engine gives them, every request's record and placement are written, a batch's parts are
served, and the state is spread over every primary (each script's keys share a hash tag:
pdserve/shared/state/keys.py). On the fake model (tests/stack/conftest.py): what is tested is the state
on the cluster, the answers compared with the in-process fake engine's."""

from __future__ import annotations

import asyncio

import httpx
import redis
from conftest import FAKE, MODEL, fake_env
from test_pools import QUESTIONS, _ask_all, _expected

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.state import request_key, route_key
from pdserve.shared.urls import sync_redis

MAX_TOKENS = 8


def test_requests_are_served_and_recorded_with_the_state_on_three_primaries(fake, tmp_path):
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, redis_cluster=3, log_dir=tmp_path, model=FAKE,
                                    env=fake_env())
    with Stack(cfg) as stack:
        answers = asyncio.run(_ask_all(stack.url, MAX_TOKENS))
        ask = {"model": MODEL, "prompt": ["Hello", "Hi"], "max_tokens": 2, "n": 2}
        batch = httpx.post(stack.url + "/v1/completions", json=ask, timeout=120)
        store = sync_redis(stack.redis_url)
        assert isinstance(store, redis.RedisCluster)
        rids = {q: a["id"].removeprefix("chatcmpl-") for q, a in answers.items()}
        phases = {q: store.hget(request_key(rid), "phase") for q, rid in rids.items()}
        placed = {q: store.exists(route_key(rid)) for q, rid in rids.items()}
        keys_per_primary = [n.redis_connection.dbsize() for n in store.get_primaries()]
        store.close()
    expected = _expected(fake, MAX_TOKENS)
    for q in QUESTIONS:
        assert answers[q]["choices"][0]["token_ids"] == expected[q], q
    assert set(phases.values()) == {b"finished"}, phases
    assert all(placed.values()), placed
    # a batch of prompts with choices: each part a request of its own, its keys on other slots
    assert batch.status_code == 200 and len(batch.json()["choices"]) == 4, batch.text
    assert len(keys_per_primary) == 3 and min(keys_per_primary) > 0, keys_per_primary

