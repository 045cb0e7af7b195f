"""A worker's engine passes, recorded before they run (pdserve/shared/quarantine.py): a process that
dies in a pass — a fault in a kernel, an out-of-memory kill, a bug one prompt reaches — leaves
in Redis the requests it held, for whoever moves them to charge the crash to.

Called on the engine thread before each pass (Engine.before_pass). A pass whose requests are
those last recorded writes nothing (but once, unwaited, after their first pass: none is new any
more): a write per change of membership, never one per token (but each of the passes a request
charged a crash runs alone, quarantine.runs_alone, changes it). The write is waited for,
RECORD_TIMEOUT_S at most, since a process that dies a moment later must have it in the store;
after a write that fails or times out (Redis away) none is made for AWAY_S: a slow store
costs crash records, never serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Collection, Coroutine

from pdserve.shared.engine.sequence import Sequence
from pdserve.shared.messages import WorkerBatch

log = logging.getLogger(__name__)
RECORD_TIMEOUT_S = 0.25
AWAY_S = 5.0
CRASH_EXIT_CODE = 70  # fault injection's exit (os._exit: no cleanup, as a crash)


class Batches:
    def __init__(self, worker: str, write: Callable[[WorkerBatch], Coroutine[object, object, None]],
                 crash_on: str = "", text: Callable[[list[int]], str] | None = None):
        self.worker, self.write = worker, write
        self.incarnation = f"{time.time_ns() // 1_000_000:x}"  # this life: its start, in ms
        self.loop: asyncio.AbstractEventLoop | None = None     # the worker's (set once it runs)
        self.recorded: frozenset[str] = frozenset()            # the requests of the pass last recorded
        self.current: frozenset[str] = frozenset()             # of the pass before this one
        self.passed: set[str] = set()      # requests with a pass done in this life (not new any more)
        self.has_new = False               # the last record names new requests
        self.writing = asyncio.Lock()
        self.away_until = 0.0
        self.crash_on, self.text = crash_on, text  # fault injection: a pass holding a prompt with this text dies

    def before_pass(self, seqs: list[Sequence], resident: Collection[str]) -> None:
        """On the engine thread: `seqs` about to be computed (the pass before, if any, is done);
        `resident`, every request the engine holds (what `passed` keeps)."""
        ids = frozenset(s.request_id for s in seqs)
        self.passed |= self.current
        self.current = ids
        if ids == self.recorded:
            if self.has_new:  # its new requests had their first pass: no longer the suspects (not waited for)
                self.has_new = False
                self.record(WorkerBatch(worker=self.worker, incarnation=self.incarnation, requests=sorted(ids)),
                            wait=False)
            return
        self.passed.intersection_update(resident)
        self.recorded = ids
        new = [s for s in seqs if s.request_id not in self.passed]
        self.has_new = bool(new)
        self.record(WorkerBatch(worker=self.worker, incarnation=self.incarnation, requests=sorted(ids),
                                new=sorted({s.request_id for s in new})))
        if self.crash_on and self.text is not None and any(self.crash_on in self.text(s.token_ids[:s.num_prompt])
                                                           for s in new):
            log.critical("fault injection: a pass holds a prompt with %r; dying", self.crash_on)
            os._exit(CRASH_EXIT_CODE)

    def record(self, batch: WorkerBatch, wait: bool = True) -> None:
        if self.loop is None or time.monotonic() < self.away_until:
            return
        try:
            written = asyncio.run_coroutine_threadsafe(self.in_order(batch), self.loop)
            if wait:
                written.result(RECORD_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - Redis away or slow: serve on, recording nothing for a while
            log.warning("engine pass not recorded (%s); none recorded for %.0f s", str(e) or type(e).__name__, AWAY_S)
            self.away_until = time.monotonic() + AWAY_S

    async def in_order(self, batch: WorkerBatch) -> None:
        """On the loop: one write at a time, in the order made (a later record never lands first)."""
        async with self.writing:
            await self.write(batch)
