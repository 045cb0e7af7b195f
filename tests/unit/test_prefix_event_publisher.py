"""A worker's side of PD_PREFIX_INDEX=events (pdserve/shared/prefix_events.py, EngineHost's count): its
changes counted as drained and numbered in messages, a lost message moving the count on, and a
snapshot answered page by page from one copy taken with its count."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdserve.shared import prefix_events
from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.engine.engine import Pass
from pdserve.shared.engine_host import EngineHost
from pdserve.shared.messages import PrefixEvents, PrefixSnapshot, PrefixSnapshotAsk
from pdserve.shared.prefix_events import PrefixEventPublisher


class Engine:
    """An engine whose steps change its prefix cache as told."""

    def __init__(self) -> None:
        self.cache: set[int] = set()
        self.pending: list[CacheChange] = []
        self.last_pass = Pass(0, 0)
        self.cfg = SimpleNamespace(max_batched_tokens=16)

    def store(self, *hashes: int) -> None:
        self.cache |= set(hashes)
        self.pending += [CacheChange("stored", h) for h in hashes]

    def step(self) -> list:
        return []

    def drain_cache_changes(self) -> list[CacheChange]:
        out, self.pending = self.pending, []
        return out

    def cached_hashes(self) -> list[int]:
        return sorted(self.cache)


class Bus:
    """What the publisher uses of pdserve.shared.bus.Bus: JetStream publish (which may fail) and respond."""

    def __init__(self) -> None:
        self.published: list[PrefixEvents] = []
        self.answers: list[PrefixSnapshot] = []
        self.fail = 0
        self.js = SimpleNamespace(publish=self._publish)

    async def _publish(self, subject: str, data: bytes) -> None:
        if self.fail:
            self.fail -= 1
            raise TimeoutError
        self.published.append(PrefixEvents.decode(data))

    async def respond(self, msg: SimpleNamespace, reply: PrefixSnapshot) -> None:
        self.answers.append(reply)


def test_the_host_counts_the_changes_it_hands_on_and_a_snapshot_carries_that_count():
    async def run() -> tuple:
        engine, handed = Engine(), []
        host = EngineHost(engine, handed.extend)  # type: ignore[arg-type]
        engine.store(1, 2)
        await host.step()
        engine.store(3)                       # not drained yet: in the snapshot, counted after it
        snap = await host.cache_snapshot()
        await host.step()
        host.close()
        return snap, host.cache_changes, len(handed)

    (hashes, seq), count, handed = asyncio.run(run())
    assert hashes == [1, 2, 3] and seq == 2 and count == handed == 3


def test_messages_net_each_chunk_and_number_the_changes():
    changes = [CacheChange("stored", h) for h in range(prefix_events.CHUNK + 5)] + [CacheChange("evicted", 3)]
    msgs = prefix_events.messages("w", "e", 10, changes)
    chunk = prefix_events.CHUNK
    assert [(m.first, m.last) for m in msgs] == [(10, 10 + chunk), (10 + chunk, 16 + chunk)]
    assert 3 in msgs[0].added and msgs[1].removed == [3] and len(msgs[1].added) == 5


def test_a_lost_message_moves_the_count_on_and_pages_come_from_one_copy():
    async def run() -> tuple:
        bus, cache = Bus(), list(range(prefix_events.PAGE + 3))
        taken = []

        async def snapshot() -> tuple[list[int], int]:
            taken.append(1)
            return list(cache), 7

        pub = PrefixEventPublisher(bus, "w", snapshot)  # type: ignore[arg-type]
        await pub.send([CacheChange("stored", 1)])
        bus.fail = 1
        await pub.send([CacheChange("stored", 2), CacheChange("stored", 3)])
        await pub.send([CacheChange("evicted", 1)])
        for page in (0, 1):
            ask = PrefixSnapshotAsk(router_id="r", ask="a1", page=page)
            await pub.on_ask(SimpleNamespace(data=ask.encode()))  # type: ignore[arg-type]
            cache.append(-1)                                      # the cache moves on between pages
        return bus, pub, len(taken)

    bus, pub, snapshots = asyncio.run(run())
    assert [(m.first, m.last) for m in bus.published] == [(0, 1), (3, 4)] and pub.seq == 4 and pub.lost == 1
    assert snapshots == 1 and [(a.page, a.pages, a.seq, len(a.hashes)) for a in bus.answers] == [
        (0, 2, 7, prefix_events.PAGE), (1, 2, 7, 3)]
    assert pub.taken == {}                                        # the copy dropped after its last page
