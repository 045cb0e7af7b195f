"""One simulated engine worker: a colocated worker, a prefill worker or a decode worker.

Its passes follow the engine scheduler's rules (pdserve/shared/engine/scheduler.py: `prefill_next`,
`mixed_budget`, `prefill_order`, `prefill_chunks`: the same functions, not copies); what a
pass costs comes from the worker shape's cost model (pdserve/planner/cost.py; a mixed pass: its
prompt chunks and a one-token chunk per running sequence, `Cost.mixed_s`). Decode steps between two events are
run as one stretch of equal steps (every running sequence gains a token per step): a new
prompt or an imported KV cuts the stretch at the next step boundary, as the real engine would
take them into its next pass. So the events are a few per request, not one per token (a
placement still reads every worker of the pool, as the router's does).

Workers pinned to one core (`peers`) share it: a pass takes its cost times the workers busy
there when it starts, and a peer going busy or idle ends the others' stretches at their step
under way, so they take the new share from there (a prefill pass under way keeps its share).

Simplifications (named, not hidden): a sequence's blocks for its whole max_tokens are booked
when the router places it, so a worker never preempts; no prefix cache (the traces' prompts are
drawn afresh); a step's cost is taken at the stretch's mean context.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.planner.cost import Cost
from pdserve.shared.engine.scheduler import mixed_budget, prefill_chunks, prefill_next, prefill_order

if TYPE_CHECKING:
    from pdserve.planner.cluster import Cluster


@dataclass(frozen=True)
class _Params:
    priority: int = 0
    tenant: str = ""


PARAMS = _Params()


@dataclass(eq=False, slots=True)
class Req:
    """A request and what happened to it (times in seconds of simulated time)."""

    id: int
    at: float
    prompt: int
    output: int
    kind: str = "request"
    first_at: float | None = None
    last_at: float | None = None
    # what the scheduler's rules read while it waits for its prefill
    num_computed: int = 0
    params: _Params = PARAMS
    decode: Worker | None = None     # where it is decoded (disaggregated: chosen with its prefill)

    @property
    def token_ids(self) -> range:
        return range(self.prompt)


@dataclass
class Knobs:
    """The engine settings of a pool (PD_* of its workers)."""

    kv_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 4096
    prefill_chunk: int = 2048
    mixed_batches: bool = True


@dataclass(eq=False, slots=True)
class Worker:
    worker_id: str
    role: str                  # colocated | prefill | decode
    cost: Cost
    knobs: Knobs
    sim: Cluster               # schedules events, hears of results
    queue: list[Req] = field(default_factory=list)   # prompts to prefill here, first come first
    importing: int = 0         # (decode) sequences whose KV is on its way
    # decode batch: (finish step, id, request); tokens so far = steps - joined step (+1 first)
    finishing: list[tuple[int, int, Req]] = field(default_factory=list)
    steps: int = 0             # decode steps run so far
    context: int = 0           # tokens the running sequences hold, at `steps`
    kinds: Counter = field(default_factory=Counter)
    fresh: list[Req] = field(default_factory=list)  # joined since the last decode stretch
    joining: list[Req] = field(default_factory=list)  # to join when the pass under way ends
    booked_blocks: int = 0
    queued_tokens: int = 0     # prompt tokens waiting (prefill queue)
    last_was_decode: bool = True
    last_decode_end: float = 0.0
    busy: bool = False
    version: int = 0
    stretch: tuple[float, float, int] | None = None  # (start, step seconds, steps planned) of a decode stretch
    pass_end: float = 0.0      # when the prefill pass under way ends
    # the other workers pinned to its core (see above)
    peers: list[Worker] = field(default_factory=list)
    busy_s: float = 0.0
    # time integrals of what an autoscaler would read (the queue's prompt tokens, the batch)
    queued_s: float = 0.0
    running_s: float = 0.0
    _seen: float = 0.0

    def account(self, now: float) -> None:
        """Add the queue and the batch since the last change to their time integrals."""
        dt = now - self._seen
        self.queued_s += self.queued_tokens * dt
        self.running_s += len(self.finishing) * dt
        self._seen = now

    # -- what placement reads (WorkerInfo's fields, pdserve/services/router/policy.Worker; plain attributes, kept
    # up to date by sync(): a placement reads them on every worker of the pool) ---------------
    running: int = 0
    waiting: int = 0           # queued prompts, and (decode) sequences whose KV is on its way
    free_blocks: int = 0
    growth_blocks: int = 0     # blocks are booked whole when placed (see above)
    peak: int = 0              # the largest batch it ran
    roomy: bool = True         # (decode) room for another sequence: the cluster keeps the list
    prefill_tokens_per_s: float = 0.0  # its prefill rate, as the worker would measure it
    fingerprint: str = ""      # one model: every decode worker takes every prefill worker's KV
    cached_blocks: int = 0     # no prefix cache

    def __post_init__(self) -> None:
        self.sync()

    @property
    def block_size(self) -> int:
        return self.knobs.block_size

    def sync(self) -> None:
        batch = len(self.finishing)
        self.running = batch + len(self.joining)  # joiners take their place at the next pass
        if batch > self.peak:
            self.peak = batch
        self.waiting = len(self.queue) + self.importing
        self.free_blocks = self.knobs.kv_blocks - self.booked_blocks
        if self.role != "prefill" and (self.running + self.waiting < self.knobs.max_num_seqs) != self.roomy:
            self.roomy = not self.roomy
            self.sim.roomy(self)

    def blocks_for(self, r: Req) -> int:
        return -(-(r.prompt + r.output) // self.knobs.block_size)

    # -- arrivals ------------------------------------------------------------------------------
    def book(self, r: Req, blocks: int = 1) -> None:
        """Its blocks set aside here (blocks=-1: given back)."""
        self.booked_blocks += blocks * self.blocks_for(r)
        self.sync()

    def book_prompt(self, r: Req, now: float) -> None:
        """Its prompt counted in the queue the router reads (booked when placed, as the router
        books it, even while its admission waits)."""
        self.account(now)
        self.queued_tokens += r.prompt

    def enqueue(self, r: Req, now: float, booked: bool = False) -> None:
        """A prompt to prefill here (`booked`: its tokens already counted)."""
        if not booked:
            self.book_prompt(r, now)
        self.queue.append(r)
        self.sync()
        self._wake(now)

    def join(self, r: Req, now: float) -> None:
        """A sequence whose first token is out joins the decode batch (KV imported, or prefilled
        here) when the pass under way ends (a decode stretch is cut), at once when idle."""
        self.joining.append(r)
        self.sync()
        self._wake(now)

    # -- passes --------------------------------------------------------------------------------
    def _wake(self, now: float) -> None:
        if not self.busy:
            self._resume(now)
        elif self.stretch is not None:
            self._cut(now)

    def _steps_by(self, now: float) -> int:
        """The decode stretch's steps done once the step under way at `now` ends."""
        start, step, planned = self.stretch  # type: ignore[misc]
        return min(planned, max(1, math.ceil((now - start) / step - 1e-9)))

    def _cut(self, now: float) -> None:
        """End the decode stretch under way at the step under way (the next pass looks again)."""
        start, step, planned = self.stretch  # type: ignore[misc]
        done = self._steps_by(now)
        if done < planned:
            self.stretch = (start, step, done)
            self.version += 1
            self.sim.at(start + done * step, self._end, self.version)

    def _shared(self, now: float) -> None:
        """It went busy or idle: its peers' stretches end at their step under way, and take the
        core's new share from there."""
        for p in self.peers:
            if p.stretch is not None:
                p._cut(now)

    def _sharing(self) -> int:
        return 1 + sum(p.busy for p in self.peers) if self.peers else 1

    def free_at(self, now: float) -> float:
        """When a call on its engine thread (a decode worker's admission: reserving the prompt's
        blocks) would run: at the end of the step or pass under way, now when idle."""
        if not self.busy:
            return now
        if self.stretch is None:
            return self.pass_end
        start, step, _ = self.stretch
        return start + self._steps_by(now) * step

    def _next(self, now: float) -> None:
        k, was_busy = self.knobs, self.busy
        batch = len(self.finishing) if k.mixed_batches else 0  # decode tokens riding in a prefill pass
        if self.queue and (batch or prefill_next(True, bool(self.finishing), self.last_was_decode)):
            chunks = prefill_chunks(prefill_order(self.queue, k.prefill_chunk), len(self.finishing),
                                    k.max_num_seqs, mixed_budget(k.max_batched_tokens, batch), k.prefill_chunk,
                                    self._admit)
            if chunks:
                work = [(n, r.num_computed) for r, n in chunks]
                pass_s = self.cost.mixed_s(work, batch, self.context) if batch else self.cost.prefill_s(work)
                self.last_was_decode, self.busy, self.stretch = False, True, None
                self.version += 1
                self.pass_end = now + pass_s * self._sharing()
                self.sim.at(self.pass_end, self._prefilled, self.version, chunks, now, batch > 0)
                if self.peers and not was_busy:
                    self._shared(now)
                return
        if self.finishing:
            batch = len(self.finishing)
            # prompts waiting: one step, then the scheduler looks at them again (the two alternate)
            planned = 1 if self.queue else max(1, self.finishing[0][0] - self.steps)
            step = self.cost.step_s(batch, self.context + batch * planned // 2) * self._sharing()
            self.last_was_decode, self.busy = True, True
            self.stretch = (now, step, planned)
            self.version += 1
            self.sim.at(now + planned * step, self._end, self.version)
            if self.peers and not was_busy:
                self._shared(now)
            return
        self.busy = False
        if self.peers and was_busy:
            self._shared(now)

    @staticmethod
    def _admit(r: Req) -> bool:
        return True  # its blocks were booked when it was placed (the router saw room for it)

    def _prefilled(self, now: float, version: int, chunks: list[tuple[Req, int]], started: float, mixed: bool) -> None:
        """A prefill pass ended (`mixed`: with a decode step of the batch in it)."""
        if version != self.version:
            return
        self.busy_s += now - started
        self.account(now)
        if mixed:
            self._stepped(now, now, now - started, 1)
        for r, n in chunks:
            r.num_computed += n
            self.queued_tokens -= n
            if r.num_computed == r.prompt:
                self.queue.remove(r)
                r.first_at = r.last_at = now
                if self.role == "prefill":
                    self.sim.prefilled(r, now + self.cost.handoff_s(r.prompt))
                elif r.output > 1:
                    self.join(r, now)
                else:
                    self.book(r, -1)
                    self.sim.finished(r)
        self.sync()
        self._resume(now)

    def _end(self, now: float, version: int) -> None:
        """A decode stretch ended."""
        if version != self.version:
            return
        start, step, done = self.stretch  # type: ignore[misc]
        self.stretch, self.busy_s = None, self.busy_s + now - start
        self.account(now)
        self._stepped(now, start + step, step, done)
        self._resume(now)

    def _stepped(self, now: float, first: float, step: float, done: int) -> None:
        """`done` decode steps of the batch ended by `now`, the first at `first`, `step` apart:
        their gaps (for the ITL), finished sequences."""
        gaps, batch = self.sim.gaps, len(self.finishing)
        new: dict[str, int] = {}
        for r in self.fresh:           # their first gap: from the first token (or the handoff)
            values, counts = gaps[r.kind]
            assert r.last_at is not None
            values.append(first - r.last_at)
            counts.append(1)
            new[r.kind] = new.get(r.kind, 0) + 1
        self.fresh = []
        for kind, n in self.kinds.items():
            values, counts = gaps[kind]
            if n - new.get(kind, 0):   # the others: from their last step, across any prefill passes since
                values.append(first - self.last_decode_end)
                counts.append(n - new.get(kind, 0))
            if done > 1:
                values.append(step)
                counts.append(n * (done - 1))
        self.steps += done
        self.context += batch * done
        self.last_decode_end = now
        while self.finishing and self.finishing[0][0] <= self.steps:  # stretches end at the first finish
            _, _, r = heapq.heappop(self.finishing)
            r.last_at = now
            self.context -= r.prompt + r.output
            self.kinds[r.kind] -= 1
            self.book(r, -1)                     # (and the batch's count is up to date)
            self.sim.finished(r)

    def _resume(self, now: float) -> None:
        """Between passes: who joined meanwhile enters the batch, then the next pass."""
        if self.joining:
            self.account(now)
            for r in self.joining:
                heapq.heappush(self.finishing, (self.steps + r.output - 1, r.id, r))
                self.context += r.prompt + 1
                self.kinds[r.kind] += 1
            self.fresh += self.joining
            self.joining = []
            self.sync()
        self._next(now)
