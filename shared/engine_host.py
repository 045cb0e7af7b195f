"""Runs the engine for an asyncio service: every engine call on one thread, in order.

The event loop stays free for NATS, UCX and HTTP while a step computes (torch releases the
GIL), and the engine, which is not thread-safe, is never touched by two threads at once.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from shared.engine.engine import Engine, RequestOutput


class EngineHost:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.wake = asyncio.Event()

    async def call(self, fn: Callable, *args, **kwargs):
        """Run `fn(*args, **kwargs)` on the engine thread, after every call queued before it."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args, **kwargs))

    async def run(self, on_outputs: Callable[[list[RequestOutput]], Awaitable[None]],
                  stop: asyncio.Event) -> None:
        """Step while there is work; sleep until `wake` is set otherwise. After `stop`, finish
        the sequences already in the engine, then return."""
        while True:
            self.wake.clear()  # before the check: work added after it sets wake again
            if not self.engine.has_work():
                if stop.is_set():
                    return
                waiters = [asyncio.ensure_future(self.wake.wait()), asyncio.ensure_future(stop.wait())]
                _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for w in pending:
                    w.cancel()
                continue
            outputs = await self.call(self.engine.step)
            if outputs:
                await on_outputs(outputs)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
