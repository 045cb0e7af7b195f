"""The routers' registry copy (pdserve/services/router/registry.py) over a real redis-server: reads
carry only what changed, departures and lapsed leases leave it, a Redis that restarted empty
is read whole again, and two replicas see the same workers."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.services.router.registry import RegistryCopy
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.state import State


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
        a, b = RegistryCopy(), RegistryCopy()
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
        reg = RegistryCopy(clock=lambda: now[0])
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


def test_a_bad_entry_costs_its_worker_its_place_never_the_read_of_the_others(redis_url):
    """An entry another version wrote (`v: 2`), one that is not JSON, one that names another
    worker than its key's, and capacity past the router's bounds: the others are read as
    written, the three are skipped and counted, the claim is taken as the bound."""
    from pdserve.services.router.registry import Bounds
    from pdserve.shared import metrics

    async def scenario():
        state = State.connect(redis_url)
        await state.r.flushall()
        await state.registry.heartbeat(info(1, load=3), lease_s=30)
        await state.registry._beat("decode-002", WorkerInfo(worker_id="decode-002", role="decode").encode()
                                   .replace(b'"v":1', b'"v":2'), 30)
        await state.registry._beat("decode-003", b"{not json", 30)
        await state.registry._beat("decode-004", info(1).encode(), 30)        # says it is decode-001
        await state.registry.heartbeat(WorkerInfo(worker_id="decode-005", role="decode", total_blocks=10**9,
                                                  free_blocks=10**9, running=-50, prefill_tokens_per_s=1e12),
                                       lease_s=30)
        reg = RegistryCopy(bounds=Bounds(max_blocks=4096, max_tokens_per_s=5e4))
        await reg.read(state)
        entries = await state.registry.entries(["decode-001", "decode-002", "decode-004"])
        await state.close()
        return reg.workers(), entries

    bad, clamped = metrics.BAD_REGISTRY_ENTRIES._value.get(), metrics.CLAMPED_REGISTRY_ENTRIES._value.get()
    workers, entries = asyncio.run(scenario())
    assert [w.worker_id for w in workers] == ["decode-001", "decode-005"] and workers[0].running == 3
    liar = workers[1]
    assert (liar.total_blocks, liar.free_blocks, liar.running, liar.prefill_tokens_per_s) == (4096, 4096, 0, 5e4)
    assert metrics.BAD_REGISTRY_ENTRIES._value.get() == bad + 3 + 2      # (and again by entries())
    assert metrics.CLAMPED_REGISTRY_ENTRIES._value.get() == clamped + 1
    assert entries == {"decode-001": info(1, load=3), "decode-002": None, "decode-004": None}
