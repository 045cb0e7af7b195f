"""The router's side of PD_PREFIX_INDEX=events: every worker's prefix events into the memory
index (prefix_memory.py) through their feeds (prefix_feeds.py), and the snapshots those need.

- One ordered push consumer of PD_PREFIX per router, from the messages published after it
  starts (a router starting takes each worker's snapshot instead); nats-py makes it again after
  a hole in its delivery, from the next message the router has not seen.
- A snapshot is asked page by page on `pd.prefix.snapshot.<worker>`, SNAPSHOTS_AT_ONCE workers
  at a time; a worker that does not answer is asked again RETRY_S later while its feed needs it.
- Every TICK_S: one look at the router's copy of the registry (workers gone dropped, new lives
  asked for), the snapshots still needed asked, a step of the index's sweep, the metrics
  (`pd_prefix_index_*`: feeds following or awaiting a snapshot, blocks, events, snapshots).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DeliverPolicy
from pydantic import ValidationError

from pdserve.services.router.prefix_feeds import Feeds, Snapshot
from pdserve.services.router.prefix_memory import MemoryIndex
from pdserve.shared import metrics, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.messages import PrefixEvents, PrefixSnapshot, PrefixSnapshotAsk, WorkerInfo
from pdserve.shared.tasks import Background, every

log = logging.getLogger("router.prefix")
TICK_S = 0.2
SWEEP_BUDGET = 50_000     # blocks per tick (~10 ms): a pass over 10M blocks takes ~40 s
SNAPSHOTS_AT_ONCE = 4
ASK_TIMEOUT_S = 2.0       # per page
RETRY_S = 1.0


class PrefixFollower:
    def __init__(self, bus: Bus, router_id: str, registered: Callable[[], Awaitable[list[WorkerInfo]]],
                 gone_s: float):
        self.bus, self.id, self.registered = bus, router_id, registered
        self.index = MemoryIndex()
        self.feeds = Feeds(self.index, gone_s)
        self.asking = Background(log, "prefix snapshot")
        self.in_flight: set[str] = set()
        self.not_before: dict[str, float] = {}   # worker -> when it may be asked again (it did not answer)
        self.limit = asyncio.Semaphore(SNAPSHOTS_AT_ONCE)
        self.sub: Subscription | None = None
        self.counted = (0, 0)   # the feeds' events applied and snapshots taken, as the metrics have them

    def lookup(self, hashes: list[int]) -> dict[str, int]:
        """Worker -> leading blocks of `hashes` it holds (MemoryIndex.lookup): no I/O."""
        return self.index.lookup(hashes)

    async def start(self) -> None:
        await self.bus.wait_stream(subjects.PREFIX_STREAM)
        self.sub = await self.bus.js.subscribe(subjects.PREFIX_EVENTS, stream=subjects.PREFIX_STREAM,
                                               cb=self.on_message, ordered_consumer=True,
                                               deliver_policy=DeliverPolicy.NEW)

    async def keep(self, stop: asyncio.Event) -> None:
        await every(TICK_S, self.tick, stop, log, "prefix follower")

    async def tick(self) -> None:
        for worker_id in self.feeds.registry(await self.registered(), time.monotonic()):
            self.ask(worker_id)
        awaiting = self.feeds.awaiting()
        for worker_id in awaiting:
            self.ask(worker_id)
        self.index.sweep(SWEEP_BUDGET)
        self.measure(len(awaiting))

    def measure(self, awaiting: int) -> None:
        """The feeds' gauges and counters (pdserve/shared/metrics.py: pd_prefix_index_*)."""
        metrics.PREFIX_FEEDS.labels("awaiting_snapshot").set(awaiting)
        metrics.PREFIX_FEEDS.labels("following").set(len(self.feeds.feeds) - awaiting)
        metrics.PREFIX_BLOCKS.set(len(self.index))
        metrics.PREFIX_EVENTS.inc(self.feeds.applied - self.counted[0])
        metrics.PREFIX_SNAPSHOTS.inc(self.feeds.snapshots - self.counted[1])
        self.counted = (self.feeds.applied, self.feeds.snapshots)

    async def on_message(self, msg: Msg) -> None:
        try:
            ev = PrefixEvents.decode(msg.data)
        except ValidationError as e:  # a newer version's message: its worker is resynced from snapshots
            log.warning("prefix events not read: %s", e)
            return
        if self.feeds.on_events(ev):
            self.ask(ev.worker_id)

    def ask(self, worker_id: str) -> None:
        if worker_id in self.in_flight or time.monotonic() < self.not_before.get(worker_id, 0.0):
            return
        self.in_flight.add(worker_id)
        self.asking.start(self._resync(worker_id))

    async def _resync(self, worker_id: str) -> None:
        try:
            async with self.limit:
                snap = await self.snapshot(worker_id)
        finally:
            self.in_flight.discard(worker_id)
        if snap is None:
            self.not_before[worker_id] = time.monotonic() + RETRY_S
            return
        self.not_before.pop(worker_id, None)
        if self.feeds.on_snapshot(snap):
            self.ask(worker_id)

    async def snapshot(self, worker_id: str) -> Snapshot | None:
        """The worker's whole cache, its pages from one copy; None when it does not answer."""
        ask, pages = uuid.uuid4().hex, list[PrefixSnapshot]()
        try:
            while not pages or len(pages) < pages[0].pages:
                page = await self.bus.request(subjects.prefix_snapshot(worker_id),
                                              PrefixSnapshotAsk(router_id=self.id, ask=ask, page=len(pages)),
                                              PrefixSnapshot, timeout=ASK_TIMEOUT_S)
                if pages and (page.epoch, page.seq, page.pages) != (pages[0].epoch, pages[0].seq, pages[0].pages):
                    return None  # its copy was gone (a new one answered): asked again whole
                pages.append(page)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            log.info("prefix snapshot of %s not taken: %r", worker_id, e)
            return None
        return Snapshot(worker_id, pages[0].epoch, pages[0].seq, [h for page in pages for h in page.hashes])

    async def close(self) -> None:
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception as e:  # noqa: BLE001 - NATS away: closing anyway
                log.debug("prefix events subscription: %s", e)
        for task in self.asking:
            task.cancel()
