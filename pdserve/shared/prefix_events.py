"""A worker's prefix-cache changes as an ordered stream, for routers that keep the index in
memory (PD_PREFIX_INDEX=events; pdserve/services/router/prefix_follower.py).

    PD_PREFIX                     JetStream stream, each worker's last messages kept (pdserve/shared/streams.py)
    pd.prefix.events.<worker>     PrefixEvents in order: changes (first, last] of life `epoch`, netted
    pd.prefix.snapshot.<worker>   request/reply: the whole cache, PrefixSnapshot pages

An *epoch* is one life of a worker's publisher (a new one each start). Its changes are counted
from 0 as the engine host drains them (EngineHost.cache_changes), and each message carries the
range it nets (at most CHUNK changes, `net_changes`). A message that fails to publish is not
sent again: the count moves on, and the routers see the gap at the next message or, if none
comes, in the registry (`WorkerInfo.prefix_seq` ahead of them). A snapshot's first page takes the
cache and the count it reflects together on the engine thread (EngineHost.cache_snapshot); its
other pages are read from that copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from pdserve.shared import subjects
from pdserve.shared.bus import Bus
from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.messages import PrefixEvents, PrefixSnapshot, PrefixSnapshotAsk
from pdserve.shared.prefix_index import net_changes

log = logging.getLogger("prefix_events")
CHUNK = 4096        # changes per message: ~100 KB of JSON at most (NATS's default payload limit is 1 MB)
PAGE = 16384        # hashes per snapshot page (~350 KB)
KEEP_S = 30.0       # a snapshot's copy is kept this long for its other pages
Snapshot = Callable[[], Awaitable[tuple[list[int], int]]]


def messages(worker_id: str, epoch: str, first: int, changes: list[CacheChange]) -> list[PrefixEvents]:
    """`changes` (those after the first `first`, in order) as messages of at most CHUNK changes each."""
    out = []
    for start in range(0, len(changes), CHUNK):
        piece = changes[start:start + CHUNK]
        added, removed = net_changes(piece)
        out.append(PrefixEvents(worker_id=worker_id, epoch=epoch, first=first + start,
                                last=first + start + len(piece), added=added, removed=removed))
    return out


def page_of(worker_id: str, epoch: str, seq: int, hashes: list[int], page: int) -> PrefixSnapshot:
    pages = max(1, -(-len(hashes) // PAGE))
    return PrefixSnapshot(worker_id=worker_id, epoch=epoch, seq=seq, hashes=hashes[page * PAGE:(page + 1) * PAGE],
                          page=page, pages=pages)


class PrefixEventPublisher:
    """A worker's side: its changes published in order by one task, off the step loop, and its
    snapshot answered."""

    def __init__(self, bus: Bus, worker_id: str, snapshot: Snapshot):
        self.bus, self.worker_id, self.snapshot = bus, worker_id, snapshot
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0                 # changes sent (or lost) so far, in the engine host's order
        self.lost = 0                # messages that failed to publish
        self.queue: asyncio.Queue[list[CacheChange]] = asyncio.Queue()
        self.taken: dict[str, tuple[float, int, list[int]]] = {}   # ask -> (when, seq, hashes)
        self.task: asyncio.Task | None = None
        self.sub: Subscription | None = None

    def registry_fields(self) -> dict[str, str | int]:
        """What the worker's registry entry says of it: its life and the changes published."""
        return {"prefix_epoch": self.epoch, "prefix_seq": self.seq}

    async def start(self) -> None:
        await self.bus.wait_stream(subjects.PREFIX_STREAM)
        self.sub = await self.bus.subscribe(subjects.prefix_snapshot(self.worker_id), self.on_ask)
        self.task = asyncio.create_task(self._run())

    def publish(self, changes: list[CacheChange]) -> None:
        if changes:
            self.queue.put_nowait(changes)

    async def _run(self) -> None:
        while True:
            changes = list(await self.queue.get())
            while not self.queue.empty():
                changes += self.queue.get_nowait()
            await self.send(changes)

    async def send(self, changes: list[CacheChange]) -> None:
        for msg in messages(self.worker_id, self.epoch, self.seq, changes):
            self.seq = msg.last
            try:
                await self.bus.js.publish(subjects.prefix_events(self.worker_id), msg.encode())
            except Exception as e:  # noqa: BLE001 - NATS away: the routers see the gap and ask for a snapshot
                self.lost += 1
                log.warning("prefix events %d-%d not published: %r", msg.first, msg.last, e)

    async def on_ask(self, msg: Msg) -> None:
        ask, now = PrefixSnapshotAsk.decode(msg.data), time.monotonic()
        self.taken = {k: v for k, v in self.taken.items() if now - v[0] < KEEP_S}
        if ask.page == 0 or ask.ask not in self.taken:  # (a page of a copy gone: a new copy, its seq tells)
            hashes, seq = await self.snapshot()
            self.taken[ask.ask] = (now, seq, hashes)
        _, seq, hashes = self.taken[ask.ask]
        page = page_of(self.worker_id, self.epoch, seq, hashes, ask.page)
        if page.page >= page.pages - 1:
            self.taken.pop(ask.ask, None)
        await self.bus.respond(msg, page)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception as e:  # noqa: BLE001 - NATS away: closing anyway
                log.debug("snapshot subscription: %s", e)
