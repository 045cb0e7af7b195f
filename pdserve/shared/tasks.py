"""Tasks that run to their end whoever awaits them (or nobody does), and steps run every period.

asyncio keeps only weak references to tasks, so a task nobody holds may be collected
mid-flight, and a failure nobody retrieves is reported as "never retrieved" at exit. A
`Background` holds its tasks until they end and logs their failures.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator


class Background:
    def __init__(self, log: logging.Logger, what: str, level: int = logging.WARNING):
        self.log, self.what, self.level = log, what, level  # DEBUG where the awaiter handles failures
        self.tasks: set[asyncio.Task] = set()

    def start(self, work: Coroutine | asyncio.Future) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.log(self.level, "%s failed: %s", self.what, task.exception())

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(list(self.tasks))


async def every(period_s: float, step: Callable[[], Awaitable[object]], stop: asyncio.Event,
                log: logging.Logger, what: str) -> None:
    """`step()` every `period_s` until `stop` is set; a failing step is logged and the next runs."""
    while not stop.is_set():
        try:
            await step()
        except Exception as e:  # noqa: BLE001 - Redis or NATS away: the next period tries again
            log.warning("%s failed: %s", what, e)
        try:
            await asyncio.wait_for(stop.wait(), period_s)
        except TimeoutError:
            pass
