"""Placement: where a request runs, decided from plain inputs (no I/O, no clock: the caller reads
the registry, the prefix index, its breakers and its bookings, and passes what it read).

`decide(ask, fleet, books, rules) -> Plan` is the one decision. The router (main.py: a new
request; requeue.py: a prompt whose prefill worker is gone), the capacity planner's simulator
(pdserve/planner/cluster.py) and the scale check's replay (bench/scale/check.py) all ask it:

1. `live`: the workers a placement may use (the caller filters with it before building the
   Fleet): prefill and decode workers, not draining, no step running for stall_s or longer.
2. The decode workers, best first (policy.decode_candidates: room for the prompt, then for its
   output too; the conversation's worker while it is not much busier; the load counting the
   admits booked since each registry entry was written); those the request avoids last; the
   worker a takeover asked before first. A requeue's (`Ask.bound_to`): its own worker only.
3. For each, the prefill: the prefill workers whose KV path to it is blocked (its breaker open)
   are skipped, and when every one is, the decode worker prefills; of the rest, those whose KV
   it can take (same fingerprint); the prefill choice: the one predicted to finish the prompt
   soonest (policy.choose_soonest) or round-robin at the cursor (it moves on with each remote
   placement planned); no prefill worker, or a prompt below local_prefill_below: local;
   placement=cheapest: local when the decode worker would finish it sooner, its streams' stall
   counted (policy.local_or_remote). A failover's reason says it resumed.
4. Admission: a new request (not a failover, not a requeue) whose remote prefill is predicted
   past the TTFT objective is refused (policy.within_objective).

A Plan yields its placements in the order to try them (the first made at once, the others only
when the first is refused), and ends with a Refusal: why no placement is left.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal

from pdserve.services.router import policy
from pdserve.services.router.policy import W
from pdserve.shared.config import RouterSettings
from pdserve.shared.messages import RouteRequest, WorkerInfo


@dataclass(frozen=True)
class Rules:
    """The router settings a placement reads (pdserve.shared.config.RouterSettings' fields)."""

    prefill_choice: Literal["soonest", "round_robin"] = "soonest"
    placement: Literal["remote", "cheapest"] = "cheapest"
    local_prefill_below: int = 0
    recompute_weight: float = 8.0
    default_prefill_tokens_per_s: float = 1000.0
    stall_weight: float = 1.0
    pool_queue_factor: float = 4.0
    affinity_slack: int = 4
    ttft_slo_s: float = 0.0  # 0: no objective

    @classmethod
    def of(cls, settings: RouterSettings) -> Rules:
        return cls(settings.prefill_choice, settings.placement, settings.local_prefill_below,
                   settings.recompute_weight, settings.default_prefill_tokens_per_s, settings.stall_weight,
                   settings.pool_queue_factor, settings.affinity_slack, settings.ttft_slo_s)


@dataclass(frozen=True)
class Ask:
    """The request's facts a placement reads."""

    prompt_tokens: int
    max_tokens: int
    generated: int = 0                 # tokens streamed before a failover: prefilled with the prompt
    attempt: int = 0
    session_worker: str | None = None  # the decode worker holding its conversation
    avoid: Collection[str] = ()        # decode workers to try last
    chosen_before: str | None = None   # the decode worker a takeover's replica asked first
    bound_to: str | None = None        # requeue: the decode worker that admitted it (only its prefill is placed)

    @property
    def tokens(self) -> int:
        """What is prefilled: the prompt and the tokens streamed before."""
        return self.prompt_tokens + self.generated

    @classmethod
    def of(cls, req: RouteRequest, session_worker: str | None = None) -> Ask:
        return cls(len(req.prompt_token_ids), req.sampling.max_tokens, len(req.generated_token_ids), req.attempt,
                   session_worker, req.avoid_workers)


@dataclass(frozen=True)
class Fleet(Generic[W]):
    """The model's live workers as the placer sees them."""

    decodes: Collection[W]
    prefills: Sequence[W]
    block_size: int = 16
    cached: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # worker -> (leading blocks of
    #                                   the prompt held, blocks in its cache): pdserve.shared.prefix_index.by_worker

    def cached_tokens(self, worker_id: str) -> int:
        return self.cached.get(worker_id, (0, 0))[0] * self.block_size


@dataclass(frozen=True)
class Books:
    """What the placer itself did lately, which the workers' registry entries may not show yet."""

    admitted: Mapping[str, int] = field(default_factory=dict)  # decode worker -> requests admitted
    sent: Mapping[str, int] = field(default_factory=dict)      # prefill worker -> prompt tokens sent
    blocked: Mapping[str, Collection[str]] = field(default_factory=dict)  # decode worker -> prefill workers
    #                                                                     whose KV path to it is shut now
    turn: int = 0                                               # the round-robin cursor


@dataclass(frozen=True)
class Placement(Generic[W]):
    """Where a request would go: its decode worker and, when prefilled remotely, its prefill
    worker; why (the reply's reason) and the kind of reason (a metric label)."""

    decode: W
    mode: policy.Mode
    reason: str
    kind: str
    prefill: policy.PrefillCandidate | None = None  # set exactly when mode == "remote"
    expected_prefill_s: float = 0.0                 # remote: the prefill's predicted time (the KV deadline)


@dataclass(frozen=True)
class Refusal:
    """Why a plan has no (further) placement: the reply's reason, its kind (a metric label), and
    when to come back (the TTFT objective: once the excess has drained)."""

    reason: str
    kind: Literal["ttft_objective", "no_decode_worker", "no_room"]
    retry_after_s: float = 0.0


class Plan(Generic[W]):
    """A decision: its placements best first, each made only when the one before it is refused
    (a large pool's ranking is not made for a request its first choice takes), then a Refusal.
    Iterated once."""

    def __init__(self, ask: Ask, fleet: Fleet[W], books: Books, rules: Rules):
        self.ask, self.fleet = ask, fleet
        self._steps = _steps(ask, fleet, books, rules)
        self.first: Placement[W] | Refusal = next(self._steps)

    @property
    def placement(self) -> Placement[W] | None:
        """The first placement (None: refused)."""
        return self.first if isinstance(self.first, Placement) else None

    def __iter__(self) -> Iterator[Placement[W] | Refusal]:
        yield self.first
        if isinstance(self.first, Placement):
            yield from self._steps


def decide(ask: Ask, fleet: Fleet[W], books: Books, rules: Rules) -> Plan[W]:
    """The placements to try, in order, and why none is left after them."""
    return Plan(ask, fleet, books, rules)


def live(workers: Iterable[WorkerInfo], stall_s: float) -> list[WorkerInfo]:
    """The prefill and decode workers a placement may use: not draining, no step hung."""
    return [w for w in workers if w.role in ("prefill", "decode") and not w.draining and w.step_s < stall_s]


def next_turn(turn: int, remote: bool) -> int:
    """The round-robin cursor once a placement is tried: it moves on with each remote one."""
    return turn + remote


def _steps(ask: Ask, fleet: Fleet[W], books: Books, rules: Rules) -> Iterator[Placement[W] | Refusal]:
    turn = books.turn
    for decode in _decodes(ask, fleet, books, rules):
        placed = _prefill(ask, decode, fleet, books, rules, turn)
        if placed.prefill is not None and not ask.attempt and ask.bound_to is None:
            ok, retry_after, why_not = policy.within_objective(placed.expected_prefill_s, rules.ttft_slo_s)
            if not ok:
                yield Refusal(why_not, "ttft_objective", retry_after)
                return
        yield placed
        turn = next_turn(turn, placed.prefill is not None)
    if not fleet.decodes:
        yield Refusal("no decode worker is up", "no_decode_worker")
    else:
        yield Refusal("no decode worker has room for this request now", "no_room")


def _query(ask: Ask, fleet: Fleet, books: Books, rules: Rules
           ) -> tuple[int, dict[str, int], int, str | None, int, int, Mapping[str, int]]:
    """policy.decode_candidates' arguments after the workers: blocks for the prompt (and the last
    token's), cached tokens per worker, prompt tokens, session worker, slack, output blocks, admits."""
    bs = fleet.block_size
    return (-(-(ask.tokens + 1) // bs), {w: n * bs for w, (n, _) in fleet.cached.items()}, ask.prompt_tokens,
            ask.session_worker, rules.affinity_slack, -(-ask.max_tokens // bs), books.admitted)


def _decodes(ask: Ask, fleet: Fleet[W], books: Books, rules: Rules) -> Iterator[W]:
    """The decode workers to ask, best first: the first found without ranking the rest (most
    requests take it); those the request avoids last; a takeover's worker first."""
    if ask.bound_to is not None:
        yield from (w for w in fleet.decodes if w.worker_id == ask.bound_to)
        return
    if not ask.avoid and not ask.chosen_before:
        best = policy.best_decode(fleet.decodes, *_query(ask, fleet, books, rules))
        if best is None:
            return
        yield best
    else:
        best = None
    ranked = policy.decode_candidates(fleet.decodes, *_query(ask, fleet, books, rules))
    ranked = sorted(ranked, key=lambda w: w.worker_id in ask.avoid)  # stable: avoided ones last
    if ask.chosen_before:
        ranked = [w for w in fleet.decodes if w.worker_id == ask.chosen_before] + [
            w for w in ranked if w.worker_id != ask.chosen_before]
    yield from (w for w in ranked if best is None or w.worker_id != best.worker_id)


def _prefill(ask: Ask, decode: W, fleet: Fleet[W], books: Books, rules: Rules, turn: int) -> Placement[W]:
    """For a prompt bound to `decode`: the prefill worker, local or remote, and why. A failover's
    prompt is the prompt and the tokens streamed before it: placed like a new request's, so a
    prefill worker computes it (the one that prefilled the prompt holds it in its cache, and
    then computes only the tokens streamed since) and `decode` continues from its KV."""
    placed = _where(ask, decode, fleet, books, rules, turn)
    if not ask.generated or ask.bound_to is not None:
        return placed
    return Placement(placed.decode, placed.mode, f"resumed after {ask.generated} tokens (attempt {ask.attempt}): "
                     f"{placed.reason}", "resumed", placed.prefill, placed.expected_prefill_s)


def _where(ask: Ask, decode: W, fleet: Fleet[W], books: Books, rules: Rules, turn: int) -> Placement[W]:
    tokens, prefills = ask.tokens, fleet.prefills
    blocked = books.blocked.get(decode.worker_id)
    healthy = [p for p in prefills if p.worker_id not in blocked] if blocked else prefills
    if prefills and not healthy:  # every path to this decode worker failing: colocated until it heals
        return Placement(decode, "local", f"KV paths to {decode.worker_id} failing (breaker open): prefilled "
                                          "there", "breaker_open")
    candidates = policy.prefill_candidates(healthy, decode.fingerprint, fleet.cached, books.sent,
                                           rules.default_prefill_tokens_per_s)
    if rules.prefill_choice == "round_robin":
        prefill, why = policy.choose_round_robin(candidates, turn)
    else:
        prefill, why = policy.choose_soonest(candidates, tokens, rules.recompute_weight)
    mode, reason = policy.placement(tokens, int(prefill is not None), rules.local_prefill_below)
    if prefill is None or mode == "local":
        return Placement(decode, "local", reason, "no_prefill_worker" if prefill is None else "short_prompt")
    kind = "round_robin" if rules.prefill_choice == "round_robin" else \
        "cached_prefix" if prefill.cached_tokens else "least_loaded"
    expected_s = policy.predicted_prefill_s(prefill, tokens)
    if rules.placement == "remote":
        return Placement(decode, "remote", why, kind, prefill, expected_s)
    mode, reason = policy.local_or_remote(
        tokens, fleet.cached_tokens(decode.worker_id), decode.running,
        decode.prefill_tokens_per_s or rules.default_prefill_tokens_per_s, prefill, rules.stall_weight,
        rules.pool_queue_factor)
    if mode == "local":
        return Placement(decode, "local", reason, "cheaper_locally")
    return Placement(decode, "remote", f"{why}; {reason}", kind, prefill, expected_s)
