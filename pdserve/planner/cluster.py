"""A simulated deployment: requests arrive, the router places them as it decides
(pdserve/services/router/placement.py `decide`: the first decode worker, then the prefill worker, local
or remote), the pools run them (pdserve/planner/worker.py), and each request's first and last token
times and every token gap are recorded.

    Layout("colocated", decode=2, decode_cost=...)            # each worker prefills and decodes
    Layout("disaggregated", prefill=1, decode=3, ...)          # P:D
    simulate(layout, requests) -> Outcome

A request no decode worker has room for waits at the router, first come first, until a
sequence finishes somewhere (the real router refuses it and the gateway asks again). A remote
prefill starts once the decode worker has admitted the request: its engine thread reserves the
blocks after the step under way (pdserve/services/decode/main.py), so the prompt waits for that step.
"""

from __future__ import annotations

import gc
import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from pdserve.planner.cost import Cost
from pdserve.planner.metrics import Timing
from pdserve.planner.worker import Knobs, Req, Worker
from pdserve.planner.workloads import Request
from pdserve.services.router import placement
from pdserve.services.router.placement import Ask, Books, Fleet, Placement, Rules


@dataclass
class Layout:
    mode: str                          # colocated | disaggregated
    decode: int                        # colocated: the workers
    decode_cost: Cost
    prefill: int = 0
    prefill_cost: Cost | None = None
    decode_knobs: Knobs = field(default_factory=Knobs)
    prefill_knobs: Knobs = field(default_factory=Knobs)
    local_below: int = 0               # PD_LOCAL_PREFILL_BELOW
    placement: Literal["remote", "cheapest"] = "cheapest"          # PD_PLACEMENT
    prefill_choice: Literal["soonest", "round_robin"] = "soonest"  # PD_PREFILL_CHOICE
    pool_queue_factor: float = 4.0     # PD_POOL_QUEUE_FACTOR
    stall_weight: float = 1.0          # PD_STALL_WEIGHT
    recompute_weight: float = 8.0
    overhead_s: float = 0.0            # the control plane's share of every token's latency
    decode_per_core: int = 1           # decode (or colocated) workers sharing one core (Worker.peers)

    def rules(self) -> Rules:
        """The router settings its placements follow."""
        return Rules(self.prefill_choice, self.placement, self.local_below, self.recompute_weight,
                     stall_weight=self.stall_weight, pool_queue_factor=self.pool_queue_factor)

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        shared = f", {self.decode_per_core} per core" if self.decode_per_core > 1 else ""
        if self.mode == "colocated":
            return f"colocated x{self.decode} (chunk {self.decode_knobs.prefill_chunk}{shared})"
        return f"{self.prefill}P:{self.decode}D{shared}"


@dataclass
class Outcome:
    requests: list[Req]
    gaps: dict[str, tuple[list[float], list[int]]]  # per request kind: token gaps (s), and how many of each
    duration_s: float
    busy: dict[str, float]             # worker → fraction of the run it was in a pass
    queued_tokens: dict[str, float]    # prefill worker → mean prompt tokens waiting (the prefill HPA's signal)
    running: dict[str, float]          # decode (or colocated) worker → mean sequences decoding

    def gap_counts(self, kind: str) -> dict[float, int]:
        """One kind's token gaps as gap → how many."""
        out: dict[float, int] = {}
        for v, n in zip(*self.gaps.get(kind, ([], []))):
            out[v] = out.get(v, 0) + n
        return out

    def timings(self, kind: str | None = None, overhead_s: float = 0.0) -> list[Timing]:
        """As the load generator's client would have seen them (pdserve/planner/metrics.py)."""
        out = []
        for r in self.requests:
            if kind is not None and r.kind != kind:
                continue
            t = Timing(sent=r.at, prompt_tokens=r.prompt)
            if r.first_at is None or r.last_at is None:
                t.ok = False
            else:
                t.chunks.append((r.first_at + overhead_s, 1))
                if r.output > 1:
                    t.chunks.append((r.last_at + overhead_s, r.output - 1))
            out.append(t)
        return out


class Cluster:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._events: list = []
        self._order = itertools.count()
        self.gaps: dict[str, tuple[list[float], list[int]]] = defaultdict(lambda: ([], []))
        role = "colocated" if layout.mode == "colocated" else "decode"
        self.decodes = [Worker(f"{role}-{i}", role, layout.decode_cost, layout.decode_knobs, self)
                        for i in range(layout.decode)]
        k = layout.decode_per_core
        for i, w in enumerate(self.decodes):
            w.peers = [p for p in self.decodes[i - i % k:i - i % k + k] if p is not w]
        cost = layout.prefill_cost or layout.decode_cost
        self.prefills = [Worker(f"prefill-{i}", "prefill", cost, layout.prefill_knobs, self)
                         for i in range(layout.prefill)]
        for w in self.prefills + self.decodes:  # what a worker's measured rate would say
            w.prefill_tokens_per_s = 512 / w.cost.prefill_s([(512, 0)])
        self.by_id = {w.worker_id: w for w in self.prefills}
        self.rules = layout.rules()
        self.turn = 0  # the round-robin cursor (placement.next_turn)
        self.backlog: list[Req] = []
        # decode workers with room for another sequence (max_num_seqs; a full one would refuse the
        # admission): kept as they change (Worker.sync), not found by reading the pool each time
        self.room: dict[Worker, None] = dict.fromkeys(self.decodes)
        self.now = 0.0

    def at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn, args))

    def run(self, requests: list[Req]) -> Outcome:
        for r in requests:
            self.at(r.at, self._arrive, r)
        events, pop = self._events, heapq.heappop
        while events:
            now, _, fn, args = pop(events)
            self.now = now
            fn(now, *args)
        start = min((r.at for r in requests), default=0.0)
        duration = max(self.now - start, 1e-9)
        workers = self.decodes + self.prefills
        for w in workers:
            w.account(self.now)
        return Outcome(requests, dict(self.gaps), duration, {w.worker_id: w.busy_s / duration for w in workers},
                       {w.worker_id: w.queued_s / duration for w in workers if w.role != "decode"},
                       {w.worker_id: w.running_s / duration for w in self.decodes})

    # -- the router ----------------------------------------------------------------------------
    def _arrive(self, now: float, r: Req) -> None:
        if not self._place(r, now):
            self.backlog.append(r)

    def decide(self, r: Req) -> Placement[Worker] | None:
        """Where the router would place `r` now (None: no decode worker has room)."""
        fleet = Fleet(self.room, self.prefills, self.layout.decode_knobs.block_size)
        return placement.decide(Ask(r.prompt, r.output), fleet, Books(turn=self.turn), self.rules).placement

    def _place(self, r: Req, now: float) -> bool:
        chosen = self.decide(r)
        if chosen is None:
            return False
        self.turn = placement.next_turn(self.turn, chosen.prefill is not None)
        d = r.decode = chosen.decode
        if chosen.prefill is None:
            d.book(r)
            d.enqueue(r, now)
            return True
        best = self.by_id[chosen.prefill.worker_id]
        d.importing += 1
        d.book(r)
        best.book_prompt(r, now)   # the router books the prefill work as it decides
        admitted = d.free_at(now)  # the decode worker reserves the blocks between two of its steps
        if admitted > now:
            self.at(admitted, self._admitted, r, best)
        else:
            best.enqueue(r, now, booked=True)
        return True

    @staticmethod
    def _admitted(now: float, r: Req, prefill: Worker) -> None:
        prefill.enqueue(r, now, booked=True)

    # -- what the workers report ---------------------------------------------------------------
    def roomy(self, w: Worker) -> None:
        """A decode worker's room for another sequence came or went."""
        if w.roomy:
            self.room[w] = None
        else:
            del self.room[w]

    def prefilled(self, r: Req, kv_ready_at: float) -> None:
        """A prefill worker published the first token; its KV lands on the decode worker then."""
        self.at(kv_ready_at, self._kv_ready, r)

    def _kv_ready(self, now: float, r: Req) -> None:
        d = r.decode
        assert d is not None
        d.importing -= 1  # (join and book bring its registry fields up to date)
        if r.output > 1:
            d.join(r, now)
        else:
            d.book(r, -1)
            self.finished(r)

    def finished(self, r: Req) -> None:
        while self.backlog and self._place(self.backlog[0], self.now):
            self.backlog.pop(0)


def as_sim(reqs: Iterable[Request]) -> list[tuple[float, int, int, str]]:
    """The load generator's requests (pdserve/planner/workloads.Request) as `simulate` takes them."""
    return [(r.at, len(r.prompt), r.max_tokens, r.kind) for r in reqs]


def simulate(layout: Layout, requests: list[tuple[float, int, int, str]]) -> Outcome:
    """`requests`: (arrival s, prompt tokens, output tokens, kind). The cyclic garbage collector
    is paused while it runs: a run makes millions of short-lived tuples and keeps every request,
    which the collector would walk again and again for the one cycle (the cluster and its
    workers), freed once it runs again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return Cluster(layout).run([Req(i, at, p, max(1, o), k) for i, (at, p, o, k) in enumerate(requests)])
    finally:
        if enabled:
            gc.enable()
