"""The router's prefix index: which of a pool's workers hold a prompt's leading blocks, behind
one interface (`PrefixIndex`) with two backends, chosen once by PD_PREFIX_INDEX (`open_index`):

- `events` (the default): the index in this router's memory, fed by the workers' prefix events
  (prefix_follower.py): a lookup does no I/O.
- `redis`: the index in Redis (pdserve/shared/prefix_index.py), keyed by each worker's slot; a lookup is
  one script call, in the round trip the route makes anyway; the dead slots' entries swept out
  by the replicas in turn.

`holding(pool, hashes, also)`: worker id -> (leading blocks of the prompt held, blocks in its
cache), and the answers of the Redis commands `also` queues (a conversation's worker), read in
that same round trip.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from redis.asyncio.client import Pipeline

from pdserve.services.router.pools import Pool
from pdserve.services.router.prefix_follower import PrefixFollower
from pdserve.shared import prefix_index
from pdserve.shared.bus import Bus
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.state import State
from pdserve.shared.tasks import Background, every

Held = dict[str, tuple[int, int]]
Queue = Callable[[Pipeline], object]


class PrefixIndex(Protocol):
    async def holding(self, pool: Pool, hashes: list[int], also: Queue | None = None) -> tuple[Held, list]: ...

    async def start(self, stop: asyncio.Event, background: Background) -> None:
        """Begin keeping the index (its upkeep runs in `background` until `stop`)."""

    async def close(self) -> None: ...


class EventsIndex:
    def __init__(self, follower: PrefixFollower, state: State):
        self.follower, self.state = follower, state

    async def holding(self, pool: Pool, hashes: list[int], also: Queue | None = None) -> tuple[Held, list]:
        held = prefix_index.by_worker(pool.ids, self.follower.lookup(hashes))
        return held, (await self.state.pipelined(also) if also is not None else [])

    async def start(self, stop: asyncio.Event, background: Background) -> None:
        await self.follower.start()
        background.start(self.follower.keep(stop))

    async def close(self) -> None:
        await self.follower.close()


class RedisIndex:
    def __init__(self, state: State, router_id: str, sweep_s: float):
        self.state, self.id, self.sweep_s = state, router_id, sweep_s
        self._slots: tuple[Pool, dict[int, WorkerInfo]] | None = None  # the pool last asked about, by slot

    def slots(self, pool: Pool) -> dict[int, WorkerInfo]:
        """The pool's workers by the slot their entries name (made once per registry read)."""
        if self._slots is None or self._slots[0] is not pool:
            self._slots = (pool, prefix_index.by_slot(pool.workers))
        return self._slots[1]

    async def holding(self, pool: Pool, hashes: list[int], also: Queue | None = None) -> tuple[Held, list]:
        if not hashes and also is None:
            return {}, []

        def build(p: Pipeline) -> None:
            if hashes:
                prefix_index.queue_lookup(self.state, p, hashes)
            if also is not None:
                also(p)
        answers = await self.state.pipelined(build)
        if not hashes:
            return {}, answers
        return prefix_index.by_worker(self.slots(pool), prefix_index.held_by_slot(answers[0])), answers[1:]

    async def start(self, stop: asyncio.Event, background: Background) -> None:
        background.start(every(self.sweep_s, lambda: prefix_index.sweep(self.state, self.id, self.sweep_s),
                               stop, logging.getLogger("router"), "prefix index sweep"))

    async def close(self) -> None:
        return None


def open_index(kind: str, bus: Bus, state: State, router_id: str,
               registered: Callable[[], Awaitable[list[WorkerInfo]]], gone_s: float, sweep_s: float) -> PrefixIndex:
    """The backend PD_PREFIX_INDEX names."""
    backends: dict[str, Callable[[], PrefixIndex]] = {
        "events": lambda: EventsIndex(PrefixFollower(bus, router_id, registered, gone_s), state),
        "redis": lambda: RedisIndex(state, router_id, sweep_s),
    }
    return backends[kind]()
