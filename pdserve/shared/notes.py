"""Request events on their way to Redis (`state.requests.note`): queued, and sent in order by one writer,
up to WRITE_BATCH events a round trip, so a burst of requests costs a few round trips rather
than a task and a pooled connection per event. The writer starts a turn of the event loop after
the event: what the request does next (a NATS message published in the same turn) goes first.

An event that carries state another process acts on is kept until it is written: a gateway's
ownership of its request (`owner`), a router's placement record (`also`), a terminal phase (it
ends the request's deadline). A Redis away delays it, and it is sent again when Redis answers.
A history-only event (a phase's time, for the timeline) is dropped when MAX_PENDING events are
waiting or when its round trip fails (counted and logged): the request's progress never waits
on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdserve.shared.lifecycle import TERMINAL

log = logging.getLogger(__name__)
MAX_PENDING = 1000   # history-only events waiting; beyond, a new one is dropped
WRITE_BATCH = 256    # events a round trip
RETRY_S = 0.5        # after a failed round trip, before the kept events are sent again


@dataclass
class Note:
    request_id: str
    phase: str
    by: str
    attempt: int
    deadline_s: float | None              # when the phase is overdue (None: no deadline)
    also: Callable[[Pipeline], None] | None  # more writes on the same round trip
    at: float                             # when it happened
    fields: dict[str, str | int]

    @property
    def kept(self) -> bool:
        """Another process acts on it: never dropped."""
        return self.also is not None or bool(self.fields.get("owner")) or self.phase in TERMINAL


class Notes:
    def __init__(self, send: Callable[[list[Note]], Awaitable[None]]):
        self.send = send                  # one round trip for a batch of events, in order
        self.queue: deque[Note] = deque()
        self.dropped = 0
        self.writer: asyncio.Task | None = None

    def add(self, note: Note) -> None:
        if not note.kept and len(self.queue) >= MAX_PENDING:
            self._drop(1, "Redis not keeping up")
            return
        self.queue.append(note)
        if self.writer is None or self.writer.done():
            self.writer = asyncio.get_running_loop().create_task(self._write())

    async def flush(self, timeout_s: float) -> None:
        """Wait, at most `timeout_s`, for what is queued to be written."""
        if self.writer is not None and not self.writer.done():
            await asyncio.wait([self.writer], timeout=timeout_s)

    async def _write(self) -> None:
        await asyncio.sleep(0)  # a turn of the loop first: a message the caller just published (the
        #                         route request, the placement's reply) is written before this round trip is built
        while self.queue:
            batch = [self.queue.popleft() for _ in range(min(len(self.queue), WRITE_BATCH))]
            try:
                await self.send(batch)
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:  # Redis away: the kept ones again
                kept = [n for n in batch if n.kept]
                self.queue.extendleft(reversed(kept))
                self._drop(len(batch) - len(kept), f"{type(e).__name__}: {e}; {len(kept)} kept")
                await asyncio.sleep(RETRY_S)
            except Exception as e:  # noqa: BLE001 - a write Redis refuses is not sent again
                self._drop(len(batch), f"{type(e).__name__}: {e}")

    def _drop(self, n: int, why: str) -> None:
        if n:
            before, self.dropped = self.dropped, self.dropped + n
            if before // 1000 != self.dropped // 1000 or before == 0:
                log.warning("request state: %d events dropped in all (%s)", self.dropped, why)
