"""API keys (hashed in configuration) and the per-caller token bucket in a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway import auth
from services.gateway.errors import APIError
from services.gateway.ratelimit import RateLimit
from shared.state import State


def test_keys_are_configured_hashed_and_checked(capsys):
    auth.main(["new", "alice"])
    out = capsys.readouterr().out
    key = out.split("key (shown once, give it to the client): ")[1].split()[0]
    entry = out.split("config entry (add to PD_API_KEYS, comma-separated): ")[1].split()[0]
    assert key.startswith("pd-") and entry == f"alice:{auth.hash_key(key)}" and key not in entry
    check = auth.KeyCheck(f"{entry}, bob:{auth.hash_key('pd-other')}")
    assert check.identify(f"Bearer {key}") == "alice" and check.identify("bearer pd-other") == "bob"
    for header, code in ((None, "missing_api_key"), ("Basic abc", "missing_api_key"), ("Bearer ", "missing_api_key"),
                         ("Bearer pd-wrong", "invalid_api_key"), (f"Bearer {key}x", "invalid_api_key")):
        with pytest.raises(APIError) as err:
            check.identify(header)
        assert err.value.status == 401 and err.value.code == code
    assert auth.KeyCheck("").open and auth.KeyCheck("").identify(None) is None


def test_a_malformed_key_entry_stops_the_start():
    with pytest.raises(ValueError, match="expected name:<64 hex digits"):
        auth.KeyCheck("alice:notahash")
    with pytest.raises(ValueError):
        auth.KeyCheck(auth.hash_key("k"))   # no name


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
