"""Placement: where a request runs, decided from plain inputs (no I/O, no clock: the caller reads
the registry, the prefix index, its breakers and its bookings, and passes what it read).

The router (services/router/main.py), the capacity planner's simulator (planner/cluster.py)
and the scale check's replay (bench/scale/check.py) all decide here, in this order:

1. `live`: the workers a placement may use: prefill and decode workers, not draining, no step
   running for stall_s or longer (hung).
2. `rank`: the decode workers, best first (policy.decode_candidates: room for the prompt, then
   for its output too; the conversation's worker while it is not much busier; the load counting
   the admits booked since each registry entry was written); those the request avoids last; the
   worker a takeover asked before first. `first`: rank's first, without ranking the rest.
3. `place_prefill`, for one decode worker: the prefill workers whose KV path to it is blocked
   (its breaker open) are skipped, and when every one is, the decode worker prefills; of the
   rest, those whose KV it can take (same fingerprint); the prefill choice: the one predicted
   to finish the prompt soonest (policy.choose_soonest) or round-robin at the cursor `turn`; no
   prefill worker, or a prompt below local_prefill_below: local; placement=cheapest: local when
   the decode worker would finish it sooner, its streams' stall counted (policy.local_or_remote).
   `plan`: the same, and a failover's reason says it resumed.
4. `next_turn`: the round-robin cursor moves on with each remote placement tried.
`decide`: 2 and 3 for the first decode worker (a caller whose first choice admits).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Generic, Literal

from services.router import policy
from services.router.policy import W
from shared.config import RouterSettings
from shared.messages import RouteRequest, WorkerInfo

if TYPE_CHECKING:
    from services.router.pools import Pool


@dataclass(frozen=True)
class Rules:
    """The router settings a placement reads (shared.config.RouterSettings' fields)."""

    prefill_choice: Literal["soonest", "round_robin"] = "soonest"
    placement: Literal["remote", "cheapest"] = "cheapest"
    local_prefill_below: int = 0
    recompute_weight: float = 8.0
    default_prefill_tokens_per_s: float = 1000.0
    stall_weight: float = 1.0
    pool_queue_factor: float = 4.0
    affinity_slack: int = 4

    @classmethod
    def of(cls, settings: RouterSettings) -> Rules:
        return cls(settings.prefill_choice, settings.placement, settings.local_prefill_below,
                   settings.recompute_weight, settings.default_prefill_tokens_per_s, settings.stall_weight,
                   settings.pool_queue_factor, settings.affinity_slack)


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

    @property
    def tokens(self) -> int:
        """What is prefilled: the prompt and the tokens streamed before."""
        return self.prompt_tokens + self.generated

    @classmethod
    def of(cls, req: RouteRequest, session_worker: str | None = None, chosen_before: str | None = None) -> Ask:
        return cls(len(req.prompt_token_ids), req.sampling.max_tokens, len(req.generated_token_ids), req.attempt,
                   session_worker, req.avoid_workers, chosen_before)


@dataclass(frozen=True)
class Fleet(Generic[W]):
    """The model's live workers as the placer sees them."""

    decodes: Collection[W]
    prefills: Sequence[W]
    block_size: int = 16
    cached: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # worker -> (leading blocks of
    #                                   the prompt held, blocks in its cache): shared.prefix_index.by_worker

    @classmethod
    def of(cls, pool: Pool, cached: Mapping[str, tuple[int, int]]) -> Fleet[WorkerInfo]:
        """A model's pool as the router last read it (pools.py) and the prefix index's answer."""
        return Fleet(pool.decodes, pool.prefills, pool.block_size, cached)

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


def live(workers: Iterable[WorkerInfo], stall_s: float) -> list[WorkerInfo]:
    """The prefill and decode workers a placement may use: not draining, no step hung."""
    return [w for w in workers if w.role in ("prefill", "decode") and not w.draining and w.step_s < stall_s]


def _decode_query(ask: Ask, fleet: Fleet, books: Books, rules: Rules
                  ) -> tuple[int, dict[str, int], int, str | None, int, int, Mapping[str, int]]:
    """policy.decode_candidates' arguments after the workers: blocks for the prompt (and the last
    token's), cached tokens per worker, prompt tokens, session worker, slack, output blocks, admits."""
    bs = fleet.block_size
    return (-(-(ask.tokens + 1) // bs), {w: n * bs for w, (n, _) in fleet.cached.items()}, ask.prompt_tokens,
            ask.session_worker, rules.affinity_slack, -(-ask.max_tokens // bs), books.admitted)


def rank(ask: Ask, fleet: Fleet[W], books: Books, rules: Rules) -> list[W]:
    """The decode workers to ask, best first; those the request avoids last; when taking over a
    placement, the worker already asked first (it may hold the request)."""
    ranked = policy.decode_candidates(fleet.decodes, *_decode_query(ask, fleet, books, rules))
    ranked = sorted(ranked, key=lambda w: w.worker_id in ask.avoid)  # stable: avoided ones last
    if ask.chosen_before:
        ranked = [w for w in fleet.decodes if w.worker_id == ask.chosen_before] + [
            w for w in ranked if w.worker_id != ask.chosen_before]
    return ranked


def first(ask: Ask, fleet: Fleet[W], books: Books, rules: Rules) -> W | None:
    """rank's first (None: no decode worker has room), found without ranking the rest."""
    if ask.avoid or ask.chosen_before:
        return next(iter(rank(ask, fleet, books, rules)), None)
    return policy.best_decode(fleet.decodes, *_decode_query(ask, fleet, books, rules))


def place_prefill(ask: Ask, decode: W, fleet: Fleet[W], books: Books, rules: Rules) -> Placement[W]:
    """For a prompt bound to `decode`: the prefill worker, local or remote, and why."""
    tokens, prefills = ask.tokens, fleet.prefills
    blocked = books.blocked.get(decode.worker_id)
    healthy = [p for p in prefills if p.worker_id not in blocked] if blocked else prefills
    if prefills and not healthy:  # every path to this decode worker failing: colocated until it heals
        return Placement(decode, "local", f"KV paths to {decode.worker_id} failing (breaker open): prefilled "
                                          "there", "breaker_open")
    candidates = policy.prefill_candidates(healthy, decode.fingerprint, fleet.cached, books.sent,
                                           rules.default_prefill_tokens_per_s)
    if rules.prefill_choice == "round_robin":
        prefill, why = policy.choose_round_robin(candidates, books.turn)
    else:
        prefill, why = policy.choose_soonest(candidates, tokens, rules.recompute_weight)
    mode, reason = policy.placement(tokens, int(prefill is not None), rules.local_prefill_below)
    if prefill is None or mode == "local":
        return Placement(decode, "local", reason, "no_prefill_worker" if prefill is None else "short_prompt")
    kind = "round_robin" if rules.prefill_choice == "round_robin" else \
        "cached_prefix" if prefill.cached_tokens else "least_loaded"
    if rules.placement == "remote":
        return Placement(decode, "remote", why, kind, prefill)
    mode, reason = policy.local_or_remote(
        tokens, fleet.cached_tokens(decode.worker_id), decode.running,
        decode.prefill_tokens_per_s or rules.default_prefill_tokens_per_s, prefill, rules.stall_weight,
        rules.pool_queue_factor)
    if mode == "local":
        return Placement(decode, "local", reason, "cheaper_locally")
    return Placement(decode, "remote", f"{why}; {reason}", kind, prefill)


def plan(ask: Ask, decode: W, fleet: Fleet[W], books: Books, rules: Rules) -> Placement[W]:
    """Where the prompt is prefilled if `decode` takes the request. A failover's prompt is the
    prompt and the tokens streamed before it: placed like a new request's, so a prefill worker
    computes it (the one that prefilled the prompt holds it in its cache, and then computes only
    the tokens streamed since) and `decode` continues from its KV."""
    placement = place_prefill(ask, decode, fleet, books, rules)
    if not ask.generated:
        return placement
    return replace(placement, kind="resumed", reason=f"resumed after {ask.generated} tokens "
                                                     f"(attempt {ask.attempt}): {placement.reason}")


def decide(ask: Ask, fleet: Fleet[W], books: Books, rules: Rules) -> Placement[W] | None:
    """The placement on the first decode worker (None: none has room)."""
    decode = first(ask, fleet, books, rules)
    return None if decode is None else plan(ask, decode, fleet, books, rules)


def next_turn(turn: int, remote: bool) -> int:
    """The round-robin cursor once a placement is tried: it moves on with each remote one."""
    return turn + remote
