"""The prefix index against a real redis-server: a worker's cache changes in, a router's question out."""

from __future__ import annotations

import asyncio

from pdserve.shared import prefix_index
from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.prefix_index import PrefixPublisher, cached_blocks, lookup, sweep
from pdserve.shared.state import State


def _info(wid: str, pub: PrefixPublisher | None) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role="prefill", prefix_slot=pub.slot if pub else 0,
                      cached_blocks=pub.size if pub else 0)


async def _written(pub: PrefixPublisher, size: int) -> None:
    """Until the publisher's updates have landed (a slow machine: no fixed sleep)."""
    for _ in range(200):
        if pub.size == size:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{pub.worker_id}: {pub.size} blocks indexed, {size} expected")


def test_a_worker_publishes_and_a_router_reads_leading_blocks(redis_url):
    async def run():
        state = State.connect(redis_url)
        await state.r.flushdb()
        pub = PrefixPublisher(state, "w1", lease_s=3)
        await pub.start()
        big = (1 << 64) - 5                                   # beyond int64: stored signed
        pub.publish([CacheChange("stored", h) for h in (11, 12, 13, big)])
        pub.publish([CacheChange("evicted", 12)])
        other = PrefixPublisher(state, "w2", lease_s=3)
        await other.start()
        other.publish([CacheChange("stored", h) for h in (11, 12)])
        await _written(pub, 3)
        await _written(other, 2)
        router = State.connect(redis_url)
        got = await cached_blocks(router, [_info("w1", pub), _info("w2", other), _info("w3", None)], [11, 12, 13])
        held_big = await lookup(router, [11, big])
        ttl = await state.r.pttl(prefix_index.live_key(pub.slot))
        slot = pub.slot
        await pub.close()
        await other.close()
        lease_gone = await state.r.exists(prefix_index.live_key(slot))
        await state.close()
        await router.close()
        return got, held_big, (slot, other.slot), ttl, lease_gone

    got, held_big, (slot, other_slot), ttl, lease_gone = asyncio.run(run())
    # 12 was evicted on w1: only its first block leads; w2 holds two; w3 has no slot (holds none: absent)
    assert got == {"w1": (1, 3), "w2": (2, 2)}
    assert held_big == {slot: 2, other_slot: 1}   # a slot counts only while it holds every block so far
    assert 0 < ttl <= 3000 and lease_gone == 0   # the slot's lease; dropped when the worker stops


def test_a_restarted_worker_takes_a_new_slot_and_the_old_one_is_swept(redis_url):
    """A worker's previous life (same id) leaves entries under its old slot: nobody reads them
    (the registry names the new slot) and the sweeper removes them once the old lease lapsed."""
    async def run():
        state = State.connect(redis_url)
        await state.r.flushdb()
        old = PrefixPublisher(state, "w1", lease_s=0.3)
        await old.start()
        old.publish([CacheChange("stored", h) for h in (1, 2, 3)])
        await _written(old, 3)
        old.task.cancel()                         # killed: no close, its lease runs out
        new = PrefixPublisher(state, "w1", lease_s=3)
        await new.start()
        new.publish([CacheChange("stored", 1)])
        await _written(new, 1)
        while await state.r.exists(prefix_index.live_key(old.slot)):
            await asyncio.sleep(0.05)
        before = await cached_blocks(state, [_info("w1", new)], [1, 2, 3])
        stale_before = await lookup(state, [1, 2, 3])
        changed, steps = 0, 0
        while await state.r.hexists(prefix_index.SLOTS, old.slot):
            await state.r.delete(prefix_index.SWEEP + ":turn")  # one caller here: no need to wait a turn
            changed += await sweep(state, "router-a", 1.0)
            steps += 1
        after = await lookup(state, [1, 2, 3])
        await new.close()
        await state.close()
        return old.slot, new.slot, before, stale_before, after, changed, steps

    old_slot, new_slot, before, stale_before, after, changed, steps = asyncio.run(run())
    assert new_slot != old_slot and before == {"w1": (1, 1)}
    assert stale_before == {old_slot: 3, new_slot: 1}
    assert after == {new_slot: 1} and changed == 3
    assert steps == prefix_index.BUCKETS // prefix_index.SWEEP_BUCKETS


def test_a_lost_index_is_rewritten_whole_from_the_engine_cache(redis_url):
    """Redis restarted without persistence (here: FLUSHALL): at the next refresh the worker
    finds its slot gone and writes its whole cache under a new one, not only the events since."""
    async def run():
        state = State.connect(redis_url)
        cache = {21, 22, 23}

        async def snapshot():
            return sorted(cache)

        pub = PrefixPublisher(state, "w3", lease_s=0.6, snapshot=snapshot)
        await pub.start()
        pub.publish([CacheChange("stored", h) for h in sorted(cache)])
        await asyncio.sleep(0.1)
        first_token = pub.token
        await state.r.flushall()
        cache.add(24)
        pub.publish([CacheChange("stored", 24)])   # only this change comes as an event after the loss
        for _ in range(100):                   # a slow machine: wait for the rewrite, not a fixed time
            held = await cached_blocks(state, [_info("w3", pub)], [21, 22, 23, 24])
            if held == {"w3": (4, 4)}:
                break
            await asyncio.sleep(0.05)
        await pub.close()
        await state.close()
        return first_token, pub.token, held

    first, second, held = asyncio.run(run())
    # a new life (after a flush its number may be the old one again: slots restart at 1)
    assert second != first and held == {"w3": (4, 4)}


def test_leading_blocks_of_many_holders_as_they_drop_out(redis_url):
    """Three workers share a prefix (one value string for runs of blocks): each counts up to its
    first missing block — c holds block 5 again, but not 4."""
    async def run():
        state = State.connect(redis_url)
        await state.r.flushdb()
        held = {"a": [1, 2, 3, 4, 5], "b": [1, 2, 3], "c": [1, 2, 3, 5]}
        pubs = {}
        for wid, hashes in held.items():
            pubs[wid] = PrefixPublisher(state, wid, lease_s=3)
            await pubs[wid].start()
            pubs[wid].publish([CacheChange("stored", h) for h in hashes])
            await _written(pubs[wid], len(hashes))
        got = await cached_blocks(state, [_info(w, p) for w, p in pubs.items()], [1, 2, 3, 4, 5, 6])
        none = await lookup(state, [9, 1, 2])
        for p in pubs.values():
            await p.close()
        await state.close()
        return got, none

    got, none = asyncio.run(run())
    assert got == {"a": (5, 5), "b": (3, 3), "c": (3, 4)}
    assert none == {}
