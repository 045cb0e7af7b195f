"""The prefix index against a real redis-server: a worker's events in, a router's question out."""

from __future__ import annotations

import asyncio

from shared.engine.block_manager import KVEvent
from shared.prefix_index import PrefixPublisher, cached_blocks, net_changes, prefix_key
from shared.state import State


def test_the_last_event_per_block_wins():
    events = [KVEvent("stored", 1), KVEvent("stored", 2), KVEvent("evicted", 1), KVEvent("evicted", 3),
              KVEvent("stored", 3)]
    assert net_changes(events) == ([2, 3], [1])


def test_a_worker_publishes_and_a_router_reads_leading_blocks(redis_url):
    async def run():
        state = State.connect(redis_url)
        await state.r.sadd(prefix_key("w1"), 99)          # left over from a previous life of w1
        pub = PrefixPublisher(state, "w1", lease_s=3)
        await pub.start()
        pub.publish([KVEvent("stored", h) for h in (11, 12, 13)])
        pub.publish([KVEvent("evicted", 12)])
        await asyncio.sleep(0.2)
        got = await cached_blocks(State.connect(redis_url), ["w1", "w2"], [11, 12, 13, 99])
        ttl = await state.r.pttl(prefix_key("w1"))
        await pub.close()
        gone = await state.r.exists(prefix_key("w1"))
        await state.close()
        return got, ttl, gone

    got, ttl, gone = asyncio.run(run())
    assert got == {"w1": (1, 2), "w2": (0, 0)}   # 12 was evicted: only the first block leads; 99 was reset
    assert 0 < ttl <= 3000 and gone == 0   # expires with the lease; removed when the worker stops


def test_a_lost_set_is_rewritten_whole_from_the_engine_cache(redis_url):
    """Redis restarted without persistence (here: FLUSHALL): at the next refresh the worker
    finds its set gone and rewrites it from its cache, not from the events since."""
    async def run():
        state = State.connect(redis_url)
        cache = {21, 22, 23}

        async def snapshot():
            return sorted(cache)

        pub = PrefixPublisher(state, "w3", lease_s=0.6, snapshot=snapshot)
        await pub.start()
        pub.publish([KVEvent("stored", h) for h in sorted(cache)])
        await asyncio.sleep(0.1)
        await state.r.flushall()
        cache.add(24)
        pub.publish([KVEvent("stored", 24)])   # only this change comes as an event after the loss
        await asyncio.sleep(0.8)
        held = sorted(int(h) for h in await state.r.smembers(prefix_key("w3")))
        await pub.close()
        await state.close()
        return held

    assert asyncio.run(run()) == [21, 22, 23, 24]
