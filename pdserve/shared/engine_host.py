"""Runs the engine for an asyncio service: every engine call on one thread, in order.

The event loop stays free for NATS, UCX and HTTP while a step computes (torch releases the
GIL), and the engine, which is not thread-safe, is never touched by two threads at once.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from pdserve.shared import metrics
from pdserve.shared.cores import Share
from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.engine.engine import Engine, Pass, RequestOutput
from pdserve.shared.engine_ahead import Ahead

P = ParamSpec("P")
T = TypeVar("T")
RECENT_STEPS = 32


class EngineHost:
    def __init__(self, engine: Engine, on_cache_changes: Callable[[list[CacheChange]], None] | None = None,
                 fault_hang_after_steps: int = 0, role: str = "engine", fault_raise_after_steps: int = 0):
        self.engine, self.role = engine, role
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.wake = asyncio.Event()
        self.on_cache_changes = on_cache_changes       # the step's prefix-cache changes (prefix index)
        self.cache_changes = 0  # prefix-cache changes drained (and handed on) so far, counted on the engine thread
        self.prefill_tokens_per_s = 0.0        # recent prefill passes, smoothed
        self.steps, self.step_started = 0, 0.0  # monotonic start of the step running now (0: none)
        self.recent_steps: deque[float] = deque(maxlen=RECENT_STEPS)  # durations of the last steps
        self.fault_hang_after_steps = fault_hang_after_steps  # fault injection: a step that never ends
        self.fault_raise_after_steps = fault_raise_after_steps  # fault injection: a step that raises
        self.cores: Share | None = None  # threads lent between the host's workers (PD_CORE_BOARD)
        self.calls_queued, self._calls_lock = 0, threading.Lock()  # calls made and not begun yet

    @property
    def step_s(self) -> float:
        """How long the current step has run (a hung step shows here while heartbeats go on)."""
        started = self.step_started
        return time.monotonic() - started if started else 0.0

    async def step(self) -> list[RequestOutput]:
        """One engine step on the engine thread; measures prefill passes, hands on prefix-cache changes."""
        outputs, changes, done, elapsed = await self.call(self.step_here)
        self.stepped(changes, done, elapsed)
        return outputs

    def step_here(self) -> tuple[list[RequestOutput], list[CacheChange], Pass, float]:
        """On the engine thread: one step, the prefix-cache changes it made, what it computed, its seconds."""
        start = time.perf_counter()
        self.step_started, self.steps = time.monotonic(), self.steps + 1
        if self.fault_hang_after_steps and self.steps > self.fault_hang_after_steps:
            threading.Event().wait()
        if self.fault_raise_after_steps and self.steps > self.fault_raise_after_steps:
            raise RuntimeError(f"fault injection: engine step {self.steps} raised")
        try:
            if self.cores is not None:
                self.cores.before_step()
            outputs = self.engine.step()
        finally:
            self.step_started = 0.0
            if self.cores is not None:
                self.cores.after_step(self.engine.has_work())
        changes = self.engine.drain_cache_changes()
        self.cache_changes += len(changes)
        return outputs, changes, self.engine.last_pass, time.perf_counter() - start

    def stepped(self, changes: list[CacheChange], done: Pass, elapsed: float) -> None:
        """On the loop, after each step: its measures, its prefix-cache changes handed on."""
        self.recent_steps.append(elapsed)
        if done.kind != "idle":  # (a step with nothing schedulable computed nothing)
            metrics.STEP_SECONDS.labels(self.role, done.kind).observe(elapsed)
        if done.prefill_tokens >= 16 and elapsed > 0:  # (a mixed pass's decode rows ride in the same products)
            rate = (done.prefill_tokens + done.decode_tokens) / elapsed
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
                0.8 * self.prefill_tokens_per_s + 0.2 * rate
        if changes and self.on_cache_changes is not None:
            self.on_cache_changes(changes)

    async def cache_snapshot(self) -> tuple[list[int], int]:
        """Every hash in the prefix cache now, and how many changes were drained before it: it
        holds their effect (and maybe some of the next ones', which re-state what it holds)."""
        return await self.call(lambda: (self.engine.cached_hashes(), self.cache_changes))

    @property
    def slowest_step_s(self) -> float:
        """How long a step of this worker may take under its present load (a step running far
        longer is hung): the longest of its last RECENT_STEPS steps, or a full prefill pass
        (`max_batched_tokens`) at its measured rate if longer (a burst after idle steps)."""
        full_pass = self.engine.cfg.max_batched_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else 0.0
        return max(max(self.recent_steps, default=0.0), full_pass)

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn(*args, **kwargs)` on the engine thread, after every call queued before it."""
        self._queued(1)
        work = self._thread.submit(self._begin, functools.partial(fn, *args, **kwargs))
        work.add_done_callback(self._dropped)
        return await asyncio.wrap_future(work)

    def _begin(self, fn: Callable[[], T]) -> T:
        self._queued(-1)
        return fn()

    def _dropped(self, work: Future) -> None:
        if work.cancelled():  # (its caller gave up before it began: it never will)
            self._queued(-1)

    def _queued(self, n: int) -> None:
        with self._calls_lock:
            self.calls_queued += n

    @property
    def calls_wait(self) -> bool:
        """A call is queued behind the one the engine thread runs (read there: steps run ahead until one is)."""
        return self.calls_queued > 0

    async def run(self, on_outputs: Callable[[list[RequestOutput]], Awaitable[None]],
                  stop: asyncio.Event, overlap: bool = False) -> None:
        """Step while there is work; sleep until `wake` is set otherwise. After `stop`, finish
        the sequences already in the engine, then return.

        `overlap` (engine_ahead.py): the engine thread steps on by itself while there is work
        and no call waits for it, and each step's outputs are handed on while the next step
        computes, in order; `on_outputs(outputs)` is then called on the engine thread as its
        step ends (what it does before it returns its awaitable is in order with the engine's
        calls) and what it returns is awaited on the loop."""
        if overlap:
            await Ahead(self, on_outputs).run(stop)
            return
        while True:
            self.wake.clear()  # before the check: work added after it sets wake again
            if not self.engine.has_work():
                if stop.is_set():
                    return
                await self.idle(stop)
                continue
            outputs = await self.step()
            if outputs:
                await on_outputs(outputs)

    async def idle(self, stop: asyncio.Event) -> None:
        """Until `wake` or `stop` is set."""
        waiters = [asyncio.ensure_future(self.wake.wait()), asyncio.ensure_future(stop.wait())]
        _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
