"""The prefix index against a real redis-server: a worker's events in, a router's question out."""

from __future__ import annotations

import asyncio

from shared import prefix_index
from shared.engine.block_manager import KVEvent
from shared.messages import WorkerInfo
from shared.prefix_index import PrefixPublisher, cached_blocks, field, lookup, net_changes, sweep
from shared.state import State


def _info(wid: str, pub: PrefixPublisher | None) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role="prefill", prefix_slot=pub.slot if pub else 0,
                      cached_blocks=pub.size if pub else 0)


def test_the_last_event_per_block_wins():
    events = [KVEvent("stored", 1), KVEvent("stored", 2), KVEvent("evicted", 1), KVEvent("evicted", 3),
              KVEvent("stored", 3)]
    assert net_changes(events) == ([2, 3], [1])


def test_hashes_are_stored_as_signed_64_bit_integers():
    assert field(5) == 5 and field((1 << 64) - 1) == -1 and field(1 << 63) == -(1 << 63)


def test_a_worker_publishes_and_a_router_reads_leading_blocks(redis_url):
    async def run():
        state = State.connect(redis_url)
        await state.r.flushdb()
        pub = PrefixPublisher(state, "w1", lease_s=3)
        await pub.start()
        big = (1 << 64) - 5                                   # beyond int64: stored signed
        pub.publish([KVEvent("stored", h) for h in (11, 12, 13, big)])
        pub.publish([KVEvent("evicted", 12)])
        other = PrefixPublisher(state, "w2", lease_s=3)
        await other.start()
        other.publish([KVEvent("stored", h) for h in (11, 12)])
        await asyncio.sleep(0.2)
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
    # 12 was evicted on w1: only its first block leads; w2 holds two; w3 has no slot
    assert got == {"w1": (1, 3), "w2": (2, 2), "w3": (0, 0)}
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
        old.publish([KVEvent("stored", h) for h in (1, 2, 3)])
        await asyncio.sleep(0.05)
        old.task.cancel()                         # killed: no close, its lease runs out
        new = PrefixPublisher(state, "w1", lease_s=3)
        await new.start()
        new.publish([KVEvent("stored", 1)])
        await asyncio.sleep(0.5)
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
        pub.publish([KVEvent("stored", h) for h in sorted(cache)])
        await asyncio.sleep(0.1)
        first = pub.slot
        await state.r.flushall()
        cache.add(24)
        pub.publish([KVEvent("stored", 24)])   # only this change comes as an event after the loss
        await asyncio.sleep(0.8)
        held = await cached_blocks(state, [_info("w3", pub)], [21, 22, 23, 24])
        await pub.close()
        await state.close()
        return first, pub.slot, held

    first, second, held = asyncio.run(run())
    assert second != first and held == {"w3": (4, 4)}
