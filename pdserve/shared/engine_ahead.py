"""The engine stepping ahead of the event loop (`EngineHost.run(..., overlap=True)`, a decode
worker's loop): the engine thread runs step after step by itself while there is work, no call
waits for it (an admit's reservation, a cancel: each waits one step at most, as before) and
fewer than AHEAD steps' outputs wait to be handed on; the loop hands each step's outputs on
(a decode worker: publishes its chunks) while the next step computes.

So the time between two steps is the engine's own: not the loop's wake-up, the hop of a call
to the engine thread and back, or the publishing of the step before, which a step computed in
the loop's turn waited for (bench/decode_step.py names each part). Outputs go out in the order
of their steps, one step's done before the next one's begin; a step that raises ends the loop
once the outputs of the steps before it are handed on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.engine.engine import Pass, RequestOutput

if TYPE_CHECKING:
    from pdserve.shared.engine_host import EngineHost

AHEAD = 2  # steps made and not yet handed on at which the engine thread stops (one computes while one is handed on)


class Ahead:
    def __init__(self, host: EngineHost, on_outputs: Callable[[list[RequestOutput]], Awaitable[None]]) -> None:
        self.host, self.on_outputs = host, on_outputs
        self.loop = asyncio.get_running_loop()
        self.made: asyncio.Queue[Awaitable[None] | None] = asyncio.Queue()  # each step's hand-off, in order
        self.posted = 0   # steps made (counted on the engine thread)
        self.handed = 0   # steps handed on (counted on the loop)
        self.progress = asyncio.Event()  # a step was handed on

    async def run(self, stop: asyncio.Event) -> None:
        host = self.host
        handing = asyncio.ensure_future(self.hand_on())
        try:
            while True:
                if handing.done():  # on_outputs raised: so does the loop
                    handing.result()
                host.wake.clear()  # before the checks: work added, or a step handed on, after them sets these again
                self.progress.clear()
                if self.posted - self.handed >= AHEAD:
                    await self.until(self.progress.wait(), handing)
                elif host.engine.has_work():
                    await host.call(self.steps)
                elif stop.is_set():
                    await self.until(self.made.join(), handing)
                    return
                else:
                    await host.idle(stop)
        except Exception:
            if not handing.done():  # a step raised: the steps before it are handed on first
                await asyncio.wait([handing, asyncio.ensure_future(self.made.join())],
                                   return_when=asyncio.FIRST_COMPLETED)
            raise
        finally:
            handing.cancel()
            while not self.made.empty():  # (cancelled: what was not handed on is dropped)
                left = self.made.get_nowait()
                if asyncio.iscoroutine(left):
                    left.close()

    def steps(self) -> None:
        """On the engine thread: step while there is work, no call waits and fewer than AHEAD
        steps wait to be handed on; each step's hand-off goes to the loop as it ends."""
        host = self.host
        while host.engine.has_work() and not host.calls_wait and self.posted - self.handed < AHEAD:
            outputs, changes, done, elapsed = host.step_here()
            handing = self.on_outputs(outputs) if outputs else None  # (here: in order with the engine's calls)
            self.posted += 1
            self.loop.call_soon_threadsafe(self.stepped, changes, done, elapsed, handing)

    def stepped(self, changes: list[CacheChange], done: Pass, elapsed: float, handing: Awaitable[None] | None) -> None:
        self.host.stepped(changes, done, elapsed)
        self.made.put_nowait(handing)

    async def hand_on(self) -> None:
        while True:
            handing = await self.made.get()
            try:
                if handing is not None:
                    await handing
            finally:
                self.made.task_done()
                self.handed += 1
                self.progress.set()

    @staticmethod
    async def until(waited: Awaitable[Any], handing: asyncio.Future[None]) -> None:
        """Until `waited` is done; raises what the hand-offs raised if they end first."""
        task = asyncio.ensure_future(waited)
        futures: list[asyncio.Future[Any]] = [task, handing]
        await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            handing.result()
