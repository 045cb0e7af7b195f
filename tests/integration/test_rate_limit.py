"""The per-caller token bucket, in a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.services.gateway.errors import APIError
from pdserve.services.gateway.ratelimit import RateLimit
from pdserve.shared.state import State


@pytest.fixture(scope="module")
def redis_url(redis_or_cluster_url):
    """One redis-server, then a Redis Cluster (tests/integration/conftest.py)."""
    return redis_or_cluster_url


def test_a_caller_over_its_rate_gets_429_with_retry_after_and_others_are_not_affected(redis_url):
    async def run():
        state = State.connect(redis_url)
        limit = RateLimit(state, rate_per_s=2.0, burst=3)
        results = []
        for caller in ["a"] * 4 + ["b"]:
            try:
                await limit.take(caller)
                results.append("ok")
            except APIError as e:
                results.append((e.status, e.code, e.headers["Retry-After"]))
        await asyncio.sleep(0.6)   # one request's worth refilled at 2/s
        await limit.take("a")
        await RateLimit(state, 0, 1).take("a")   # rate 0: no limit
        await state.close()
        return results

    assert asyncio.run(run()) == ["ok", "ok", "ok", (429, "rate_limit_exceeded", "1"), "ok"]


def test_a_request_takes_its_cost_and_an_absent_store_fails_closed_when_told(redis_url):
    async def run():
        state = State.connect(redis_url)
        tokens = RateLimit(state, rate_per_s=1.0, burst=100, unit="tokens")
        await tokens.take("a", 80)
        try:
            await tokens.take("a", 40)   # 20 left: 16 x max_tokens counts, not one request
        except APIError as e:
            over = (e.status, e.code, "tokens/s" in e.message)
        await state.close()
        away = State.connect("redis://127.0.0.1:1")  # nothing listens there
        results = []
        for fail_open in (True, False):
            try:
                await RateLimit(away, 1.0, 5, fail_open=fail_open).take("a")
                results.append("served")
            except APIError as e:
                results.append((e.status, e.code))
        await away.close()
        return over, results

    assert asyncio.run(run()) == ((429, "rate_limit_exceeded", True), ["served", (503, "rate_limit_unavailable")])
