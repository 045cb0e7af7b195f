"""The cluster's prefix index in Redis: which worker holds which KV blocks.

    pd:prefix:<worker>   set of the chained block hashes (shared/hashing.py) in that worker's
                         prefix cache; expires with the worker's lease

Each worker is the only writer of its own set: after every engine step it applies the
step's "stored" / "evicted" events (KVEvent, in order) in one pipeline, and it empties the
set when it starts (its cache starts empty). There is therefore no sequence number to check:
a restarted worker rewrites its set from scratch, a dead one's set expires with its lease,
and any router replica — or a restarted router — reads the same state. When the set is lost
instead (Redis restarted without persistence, or an update failed while Redis was away) the
worker rewrites it whole from its engine's cache (`snapshot`), found at the next lease
refresh at the latest. Routers ask `cached_blocks(workers, hashes)`: per worker, how many leading blocks of
a prompt it holds and how full its cache is (SMISMEMBER + SCARD per worker, pipelined).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from shared.engine.block_manager import KVEvent
from shared.state import State

log = logging.getLogger("prefix_index")


def prefix_key(worker_id: str) -> str:
    return f"pd:prefix:{worker_id}"


def net_changes(events: list[KVEvent]) -> tuple[list[int], list[int]]:
    """(hashes to add, hashes to remove): the last event per hash wins."""
    last: dict[int, str] = {}
    for e in events:
        last[e.block_hash] = e.kind
    return ([h for h, k in last.items() if k == "stored"], [h for h, k in last.items() if k == "evicted"])


class PrefixPublisher:
    """A worker's writer: batches applied in order by one task, off the step loop."""

    def __init__(self, state: State, worker_id: str, lease_s: float,
                 snapshot: Callable[[], Awaitable[list[int]]] | None = None):
        self.state, self.key, self.lease_ms = state, prefix_key(worker_id), int(lease_s * 1000)
        self.snapshot = snapshot  # every hash in the engine's prefix cache now
        self.size = 0             # members of the set after the last update
        self.queue: asyncio.Queue[list[KVEvent]] = asyncio.Queue()
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.state.r.delete(self.key)
        self.size = 0
        self.task = asyncio.create_task(self._run())

    def publish(self, events: list[KVEvent]) -> None:
        if events:
            self.queue.put_nowait(events)

    async def _run(self) -> None:
        resync = False
        while True:
            try:  # idle: still refresh the expiry, which is the worker's lease
                events = [await asyncio.wait_for(self.queue.get(), self.lease_ms / 3000)]
            except asyncio.TimeoutError:
                events = []
            while not self.queue.empty():
                events.append(self.queue.get_nowait())
            try:
                if resync and self.snapshot is not None:
                    await self._rewrite()  # the events taken above happened before it: in it already
                    resync = False
                    continue
                add, remove = net_changes([e for batch in events for e in batch])
                async with self.state.r.pipeline(transaction=True) as p:
                    p.scard(self.key)
                    if remove:
                        p.srem(self.key, *remove)
                    if add:
                        p.sadd(self.key, *add)
                    p.pexpire(self.key, self.lease_ms)
                    p.scard(self.key)
                    answers = await p.execute()
                # the only writer: the set is as the last update left it, unless it was lost
                # (Redis restarted without persistence, or the lease lapsed)
                resync, self.size = answers[0] != self.size, answers[-1]
            except Exception as e:  # Redis away: routing loses precision, not correctness
                log.warning("prefix index update failed: %s", e)
                resync = True

    async def _rewrite(self) -> None:
        hashes = await self.snapshot()
        async with self.state.r.pipeline(transaction=True) as p:
            p.delete(self.key)
            if hashes:
                p.sadd(self.key, *hashes)
                p.pexpire(self.key, self.lease_ms)
            await p.execute()
        self.size = len(set(hashes))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        await self.state.r.delete(self.key)


async def cached_blocks(state: State, worker_ids: list[str], hashes: list[int]) -> dict[str, tuple[int, int]]:
    """Per worker: (how many leading blocks of `hashes` it holds, how many blocks its cache holds)."""
    if not worker_ids:
        return {}
    async with state.r.pipeline(transaction=False) as p:
        for w in worker_ids:
            if hashes:
                p.smismember(prefix_key(w), hashes)
            p.scard(prefix_key(w))
        answers = await p.execute()
    out, it = {}, iter(answers)
    for w in worker_ids:
        held = next(it) if hashes else []
        n = 0
        for h in held:
            if not h:
                break
            n += 1
        out[w] = (n, next(it))
    return out
