"""Did the router decide as today's policy would? `make bench-scale`'s check of each run.

For every placement the router made, pdserve/services/router/placement.py (where the router decides)
is asked the same question with the same inputs: the registry entries the router read (static
during a run), the true prefix cache of every simulated worker (the plan's trace blocks;
filler is never asked for) and what that router had booked lately (pdserve/services/router/recent.py:
prompt tokens sent to each prefill worker when it decided, one admit per decode worker when
the admit was answered, each within its horizon), rebuilt from its own earlier placements in the
order their admits reached the simulated decode workers (just after each decision).
Reported:
- hit rates: cached leading tokens at the chosen prefill worker / prompt tokens, for the
  router's choices and for the policy's — the issue's figure; equal within
  HIT_RATE_TOLERANCE, with the index exact, is `hit_rate_same_as_policy` (None for a run
  the router did not keep up with: its inputs cannot be rebuilt from outside);
- the fractions of identical prefill and decode choices;
- `index_exact`: the cached tokens the router saw at its chosen worker (span attribute
  `prefill_cached_tokens`) equal the truth: the prefix index answered right;
- `booking_matched`: the queue the router saw there (`prefill_queued_tokens`) equals the
  registry's plus the rebuilt booking. Where it does not, concurrent placements decided in
  another order than their admits arrived, and the policy was asked a slightly different
  question; `same_prefill_where_booking_matched` counts the others. Decode bookings are
  not visible in the spans: their order is estimated (ADMIT_SEEN_NS).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from bench.scale.plan import FleetWorker, Probe
from pdserve.services.router import placement
from pdserve.services.router.placement import Ask, Books, Fleet, Rules
from pdserve.services.router.pools import EMPTY, pools
from pdserve.services.router.recent import horizons
from pdserve.shared.config import RouterSettings
from pdserve.shared.messages import WorkerInfo

HIT_RATE_TOLERANCE = 0.005   # the booking order of concurrent placements is not observable exactly
ADMIT_SEEN_NS = 1_000_000    # an answered admit is booked this long before a decision whose admit arrives
                             # (a NATS hop each way and a Redis round trip, on one host)


@dataclass(frozen=True)
class Placement:
    request_id: str
    probe: Probe
    max_tokens: int
    router: str                     # the replica that placed it (span attribute)
    start_ns: int                   # its router.route span began
    end_ns: int                     # and ended
    prefill: str | None             # the router's choices (RouteReply)
    decode: str | None
    seen_cached: int | None = None  # span attributes: the chosen prefill worker as the router saw it
    seen_queued: int | None = None
    asked_ns: int | None = None     # its admit reached the decode worker (just after the decision)
    answered_ns: int | None = None  # and was answered (just before the router books it)

    @property
    def decided_ns(self) -> int:
        return self.asked_ns if self.asked_ns is not None else self.start_ns

    @property
    def admitted_ns(self) -> int:
        return self.answered_ns if self.answered_ns is not None else self.end_ns


def holders(workers: list[FleetWorker]) -> dict[int, list[str]]:
    """Block hash -> the workers whose cache holds it (trace blocks; filler is never asked for)."""
    out: dict[int, list[str]] = {}
    for w in workers:
        for h in w.cached:
            out.setdefault(h, []).append(w.worker_id)
    return out


def leading(hashes: list[int], held: dict[int, list[str]]) -> dict[str, int]:
    """Per worker holding the first block: how many leading blocks of `hashes` it holds."""
    out: dict[str, int] = {}
    alive: set[str] | None = None
    for i, h in enumerate(hashes):
        now = {w for w in held.get(h, ()) if alive is None or w in alive}
        if not now:
            break
        out.update(dict.fromkeys(now, i + 1))
        alive = now
    return out


class Replay:
    """The router's decision (placement.decide) on the registry it read and the true caches."""

    def __init__(self, registry: list[WorkerInfo], sizes: dict[str, int], held: dict[int, list[str]],
                 settings: RouterSettings):
        pool = next(iter(pools(placement.live(registry, settings.stall_s)).values()), EMPTY)  # one model here
        self.prefills, self.decodes, self.bs = pool.prefills, pool.decodes, pool.block_size
        self.sizes, self.held, self.s, self.rules = sizes, held, settings, Rules.of(settings)
        self.queued = {w.worker_id: w.queued_tokens for w in self.prefills}
        self.truth: dict[int, dict[str, int]] = {}   # per probe: leading blocks per worker

    def cached(self, probe: Probe) -> dict[str, int]:
        if probe.index not in self.truth:
            self.truth[probe.index] = leading(probe.hashes, self.held)
        return self.truth[probe.index]

    def held_by(self, probe: Probe, worker: str | None) -> int:
        """Leading blocks of the probe's prompt cached on `worker` (none: 0)."""
        return self.cached(probe).get(worker, 0) if worker is not None else 0

    def decide(self, p: Placement, assigned: dict[str, int], admitted: dict[str, int], turn: int = 0
               ) -> tuple[str | None, str | None]:
        """(decode worker, prefill worker) the router would pick; prefill None when local."""
        hits = self.cached(p.probe)
        fleet = Fleet(self.decodes, self.prefills, self.bs, {w: (hits.get(w, 0), n) for w, n in self.sizes.items()})
        books = Books(admitted=admitted, sent=assigned, turn=turn)
        chosen = placement.decide(Ask(len(p.probe.tokens), p.max_tokens), fleet, books, self.rules).placement
        if chosen is None:
            return None, None
        return chosen.decode.worker_id, chosen.prefill.worker_id if chosen.prefill is not None else None


class Window:
    """What one router booked per worker within a horizon (pdserve/services/router/recent.py), replayed:
    `events` (when, worker, amount) in time order; `at(t)` the sums seen at time t."""

    def __init__(self, events: list[tuple[int, str, int]], horizon_ns: int):
        self.events, self.horizon_ns, self.next = events, horizon_ns, 0
        self.live: deque[tuple[int, str, int]] = deque()
        self.sums: dict[str, int] = {}

    def at(self, t: int) -> dict[str, int]:
        while self.next < len(self.events) and self.events[self.next][0] < t:
            self.add(self.events[self.next], 1)
            self.next += 1
        while self.live and self.live[0][0] <= t - self.horizon_ns:
            self.add(self.live.popleft(), -1)
        return {w: k for w, k in self.sums.items() if k}

    def add(self, event: tuple[int, str, int], sign: int) -> None:
        _, w, k = event
        self.sums[w] = self.sums.get(w, 0) + sign * k
        if sign > 0:
            self.live.append(event)


def booked_tokens(p: Placement, replay: Replay) -> int:
    """What the router booked on its prefill worker: the prompt less what it saw cached there."""
    seen = p.seen_cached if p.seen_cached is not None else replay.held_by(p.probe, p.prefill) * replay.bs
    return len(p.probe.tokens) - seen


def check(placements: list[Placement], replay: Replay, rebuilt: bool = True) -> dict:
    """Replay each router's placements in the order their admits arrived: prefill tokens are
    booked when a decision is made, decode admits when the admit is answered. `rebuilt`
    False: the router did not keep up (routes failed or refused, answers late), and its
    bookings are not known well enough to ask the policy the same question."""
    sent_ns, admitted_ns = (int(h * 1e9) for h in horizons(replay.s.heartbeat_s))   # the router's
    tally = Tally()
    for router in sorted({p.router for p in placements}):
        mine = sorted((p for p in placements if p.router == router), key=lambda p: p.decided_ns)
        sent = Window([(p.decided_ns, p.prefill, booked_tokens(p, replay)) for p in mine if p.prefill], sent_ns)
        admitted = Window(sorted((p.admitted_ns, p.decode, 1) for p in mine if p.decode), admitted_ns)
        turn = 0   # the round-robin cursor, moved by this router's own placements
        for p in mine:
            assigned = sent.at(p.decided_ns)
            tally.add(p, replay, assigned,
                      replay.decide(p, assigned, admitted.at(p.decided_ns - ADMIT_SEEN_NS), turn))
            turn = placement.next_turn(turn, p.prefill is not None)
    return tally.result(rebuilt)


@dataclass
class Tally:
    tokens: int = 0
    hit_router: int = 0
    hit_policy: int = 0
    same_prefill: int = 0
    same_decode: int = 0
    count: int = 0
    exact: list[bool] = field(default_factory=list)
    matched: list[bool] = field(default_factory=list)
    matched_same: int = 0

    def add(self, p: Placement, replay: Replay, assigned: dict[str, int], chosen: tuple[str | None, str | None]):
        decode, prefill = chosen
        self.count += 1
        self.tokens += len(p.probe.tokens)
        self.hit_router += replay.held_by(p.probe, p.prefill) * replay.bs
        self.hit_policy += replay.held_by(p.probe, prefill) * replay.bs
        self.same_prefill += prefill == p.prefill
        self.same_decode += decode == p.decode
        if p.seen_cached is not None:
            self.exact.append(p.seen_cached == replay.held_by(p.probe, p.prefill) * replay.bs)
        if p.seen_queued is not None and p.prefill:
            ok = p.seen_queued == replay.queued.get(p.prefill, 0) + assigned.get(p.prefill, 0)
            self.matched.append(ok)
            self.matched_same += ok and prefill == p.prefill

    def result(self, rebuilt: bool) -> dict:
        """The fractions; `hit_rate_same_as_policy`: False when the index answered wrong, None
        when the router's bookings could not be rebuilt."""
        n = max(self.count, 1)
        out: dict[str, Any] = {"placements": self.count, "hit_rate_router": self.hit_router / max(self.tokens, 1),
               "hit_rate_policy": self.hit_policy / max(self.tokens, 1), "same_prefill": self.same_prefill / n,
               "same_decode": self.same_decode / n,
               "index_exact": sum(self.exact) / len(self.exact) if self.exact else None,
               "booking_matched": sum(self.matched) / len(self.matched) if self.matched else None,
               "same_prefill_where_booking_matched": self.matched_same / sum(self.matched) if any(self.matched)
               else None}
        same = abs(out["hit_rate_router"] - out["hit_rate_policy"]) <= HIT_RATE_TOLERANCE
        if out["index_exact"] is not None and out["index_exact"] < 1.0:
            out["hit_rate_same_as_policy"] = False
        elif not self.count or not rebuilt:
            out["hit_rate_same_as_policy"] = None
        else:
            out["hit_rate_same_as_policy"] = same
        return out
