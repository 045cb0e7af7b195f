"""The routers' registry copy (services/router/registry.py) over a real redis-server: reads
carry only what changed, departures and lapsed leases leave it, a Redis that restarted empty
is read whole again, and two replicas see the same workers."""

from __future__ import annotations

import asyncio

import pytest

from services.router.registry import Registry
from shared.messages import WorkerInfo
from shared.state import State


@pytest.fixture(scope="module")
def redis_url(redis_or_cluster_url):
    """One redis-server, then a Redis Cluster (tests/integration/conftest.py)."""
    return redis_or_cluster_url


def info(i: int, load: int = 0) -> WorkerInfo:
    return WorkerInfo(worker_id=f"decode-{i:03d}", role="decode", running=load)


def test_a_read_carries_what_changed_not_the_fleet(redis_url):
    async def scenario():
        state = State.connect(redis_url)
        await state.r.flushall()
        for i in range(256):
            await state.registry.heartbeat(info(i), lease_s=30)
        a, b = Registry(), Registry()
        await a.read(state)
        first = a.changes_read
        await a.read(state)
        unchanged = a.changes_read - first
        for i in range(5):
            await state.registry.heartbeat(info(i, load=7), lease_s=30)
        await state.registry.deregister("decode-255")
        await a.read(state)
        later = a.changes_read - first
        await b.read(state)
        await state.close()
        return first, unchanged, later, a.workers(), b.workers()

    first, unchanged, later, seen_a, seen_b = asyncio.run(scenario())
    assert (first, unchanged, later) == (256, 0, 6)
    assert len(seen_a) == 255 and seen_a == seen_b
    assert [w.running for w in seen_a[:6]] == [7] * 5 + [0]


def test_a_lapsed_lease_leaves_and_an_emptied_redis_is_read_whole(redis_url):
    now = [100.0]

    async def scenario():
        state = State.connect(redis_url)
        await state.r.flushall()
        await state.registry.heartbeat(info(1), lease_s=30)
        await state.registry.heartbeat(info(2), lease_s=2)
        reg = Registry(clock=lambda: now[0])
        await reg.read(state)
        before = [w.worker_id for w in reg.workers()]
        now[0] += 2.5                                 # decode-002 did not beat again
        lapsed = [w.worker_id for w in reg.workers()]
        await state.r.flushall()                      # Redis restarted empty
        await state.registry.heartbeat(info(3), lease_s=30)
        await reg.read(state)
        after = [w.worker_id for w in reg.workers()]
        await state.close()
        return before, lapsed, after

    assert asyncio.run(scenario()) == (["decode-001", "decode-002"], ["decode-001"], ["decode-003"])
