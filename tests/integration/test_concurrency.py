"""Per-key concurrency across gateways (pdserve/services/gateway/concurrency.py) on a real Redis: each
caller's choices in flight are counted by every gateway; a request that ends frees its places;
a dead gateway's places lapse within one lease while a live gateway's are renewed; with Redis
away, a 503 (fail closed) or unchecked (fail open)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.local.servers import free_port
from pdserve.services.gateway.concurrency import Concurrency
from pdserve.services.gateway.errors import APIError
from pdserve.shared.state import State


@pytest.fixture(scope="module")
def redis_url(redis_or_cluster_url):
    """One redis-server, then a Redis Cluster (tests/integration/conftest.py)."""
    return redis_or_cluster_url

LEASE_S = 1.0


async def refused(gw: Concurrency, caller: str, rid: str, n: int = 1) -> int:
    try:
        await gw.join(caller, rid, n)
    except APIError as e:
        return e.status
    return 0


def test_a_callers_requests_in_flight_are_limited_across_gateways(redis_url):
    async def scenario():
        a, b = State.connect(redis_url), State.connect(redis_url)
        ga, gb = Concurrency(a, 2, LEASE_S, fail_open=False), Concurrency(b, 2, LEASE_S, fail_open=False)
        out = {}
        await ga.join("alice", "r1", 1)
        await gb.join("alice", "r2", 1)
        out["third, another gateway"] = await refused(gb, "alice", "r3")
        out["bob, two choices"] = await refused(gb, "bob", "r4", 2)
        ga.leave("r1")
        await asyncio.gather(*ga.leaving)
        out["after one ended"] = await refused(gb, "alice", "r3")
        out["n=2 over the limit"] = await refused(ga, "bob", "r5", 2)
        out["n=3, never"] = await refused(ga, "carol", "r8", 3)
        await asyncio.sleep(LEASE_S + 0.3)              # gateway b "died": its leases are not renewed
        out["b's places lapsed"] = await refused(ga, "alice", "r6")
        for _ in range(4):                              # a renews r6 for twice the lease
            await ga.renew()
            await asyncio.sleep(LEASE_S / 2)
        out["r6 renewed, two more"] = await refused(gb, "alice", "r7", 2)
        out["r6 renewed, one more"] = await refused(gb, "alice", "r7", 1)
        await a.close()
        await b.close()
        return out

    assert asyncio.run(scenario()) == {
        "third, another gateway": 429, "bob, two choices": 0, "after one ended": 0, "n=2 over the limit": 429,
        "n=3, never": 400, "b's places lapsed": 0, "r6 renewed, two more": 429, "r6 renewed, one more": 0}


def test_a_redis_that_restarted_empty_has_the_leases_again_at_the_next_renewal(redis_url):
    async def scenario():
        store = State.connect(redis_url)
        gw = Concurrency(store, 2, LEASE_S, fail_open=False)
        await gw.join("dave", "r1", 1)
        await gw.join("dave", "r2", 1)
        await store.r.delete("pd:inflight:dave")   # (what a restart without persistence leaves of it)
        await gw.renew()
        out = await refused(gw, "dave", "r3")
        await store.close()
        return out

    assert asyncio.run(scenario()) == 429


@pytest.mark.parametrize("fail_open, status", [(False, 503), (True, 0)])
def test_with_redis_away_the_limit_fails_closed_or_open(fail_open, status):
    async def scenario():
        store = State.connect(f"redis://127.0.0.1:{free_port()}/0")
        out = await refused(Concurrency(store, 2, LEASE_S, fail_open=fail_open), "alice", "r1")
        await store.close()
        return out

    assert asyncio.run(scenario()) == status
