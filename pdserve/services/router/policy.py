"""Placement policy: pure functions of plain numbers (no I/O), composed into one decision in
placement.py.

Prefill choice: the worker that would finish the prompt soonest — its queued work plus the part
of the prompt it does not already hold in its prefix cache, at its measured rate
(`choose_soonest`). The same functions drive the live router and the trace replay of
`make eval-router` (bench/router_eval.py).
Decode: the worker holding the conversation (session or prefix cache) unless it is much
busier than the least loaded, else the least loaded with room.
Local or remote: prompts below a length threshold, or any prompt when no prefill worker is up, are
prefilled on the decode worker itself (local); the rest in the prefill pool (remote), or where
it is cheaper (`local_or_remote`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal, NamedTuple, Protocol, TypeVar

Mode = Literal["remote", "local"]  # a placement's: the prefill pool prefills the prompt, or its decode worker


class Worker(Protocol):
    """What placement reads of a worker: its registry entry's fields (pdserve.shared.messages.WorkerInfo),
    or a simulated worker's (pdserve/planner/worker.py)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def free_blocks(self) -> int: ...
    @property
    def growth_blocks(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def queued_tokens(self) -> int: ...
    @property
    def prefill_tokens_per_s(self) -> float: ...
    @property
    def cached_blocks(self) -> int: ...


W = TypeVar("W", bound=Worker)


def placement(prompt_tokens: int, prefill_workers: int, local_below: int) -> tuple[Mode, str]:
    """Where the prompt is prefilled before costs are weighed, and why."""
    if prefill_workers == 0:
        return "local", "no prefill worker available"
    if prompt_tokens < local_below:
        return "local", f"prompt of {prompt_tokens} tokens is below the local-prefill threshold {local_below}"
    return "remote", "prefill pool"


def decode_candidates(workers: Iterable[W], blocks_needed: int, cached_tokens: Mapping[str, int] | None = None,
                      prompt_tokens: int = 0, session_worker: str | None = None,
                      affinity_slack: int = 4, output_blocks: int = 0,
                      booked: Mapping[str, int] | None = None) -> list[W]:
    """Decode workers that have room for the prompt, best first.

    A worker is *affine* when it holds the request's conversation — it is the session's
    worker, or its prefix cache holds at least half the prompt — and its load (running +
    waiting sequences) is within `affinity_slack` of the least loaded: affine workers come
    first, most cached tokens first (a follow-up turn goes back to its KV, and only its new
    blocks cross). Then the rest: those with room for the whole request first — the prompt
    and `output_blocks` of output, on top of what their own sequences may still take to reach
    their max_tokens (`growth_blocks`): a worker short of that would preempt a stream later —
    then least loaded first, most headroom first. A worker's load counts the requests admitted
    there since its registry entry was written (`booked`), so a burst spreads over the pool
    instead of piling onto the worker that looked emptiest a heartbeat ago."""
    return [row[-1] for row in sorted(_decode_rows(workers, blocks_needed, cached_tokens, prompt_tokens,
                                                   session_worker, affinity_slack, output_blocks, booked))]


def best_decode(workers: Iterable[W], blocks_needed: int, cached_tokens: Mapping[str, int] | None = None,
                prompt_tokens: int = 0, session_worker: str | None = None, affinity_slack: int = 4,
                output_blocks: int = 0, booked: Mapping[str, int] | None = None) -> W | None:
    """The first of `decode_candidates` (None: no worker has room), found without ranking the
    rest: for a caller that takes the first answer (the capacity planner's simulator)."""
    rows = _decode_rows(workers, blocks_needed, cached_tokens, prompt_tokens, session_worker, affinity_slack,
                        output_blocks, booked)
    return min(rows)[-1] if rows else None


def _decode_rows(workers: Iterable[W], blocks_needed: int, cached_tokens: Mapping[str, int] | None,
                 prompt_tokens: int, session_worker: str | None, affinity_slack: int, output_blocks: int,
                 booked: Mapping[str, int] | None) -> list[tuple]:
    """(sort key..., worker) for each worker with room: one pass over the pool (a large pool's
    placement reads every worker); the worker id ends the key, so rows never compare workers."""
    need = blocks_needed + output_blocks
    if not cached_tokens and session_worker is None and not booked:  # nothing can be affine: the plain order
        return [((h := w.free_blocks - w.growth_blocks) < need, w.running + w.waiting, -h, w.worker_id, w)
                for w in workers if w.free_blocks >= blocks_needed]
    cached, booked = cached_tokens or {}, booked or {}
    fit = [(w, w.running + w.waiting + booked.get(w.worker_id, 0)) for w in workers if w.free_blocks >= blocks_needed]
    if not fit:
        return []
    bound = min(load for _, load in fit) + affinity_slack
    rows = []
    for w, load in fit:
        held, headroom = cached.get(w.worker_id, 0), w.free_blocks - w.growth_blocks
        affine = (w.worker_id == session_worker or 2 * held >= prompt_tokens > 0) and load <= bound
        rows.append((not affine, -held if affine else 0, headroom < need, load, -headroom, w.worker_id, w))
    return rows


class PrefillCandidate(NamedTuple):  # a tuple: hundreds are made per placement in a large pool
    worker_id: str
    cached_tokens: int        # leading prompt tokens already in this worker's prefix cache
    queued_tokens: int        # prefill work waiting there before this prompt (tokens to compute)
    tokens_per_s: float       # its measured prefill rate
    cache_blocks: int = 0     # blocks in its prefix cache: on a tie, new prefixes go to the emptier


def prefill_candidates(workers: Iterable[Worker], fingerprint: str, index: Mapping[str, tuple[int, int]],
                       assigned_tokens: Mapping[str, int], default_tokens_per_s: float) -> list[PrefillCandidate]:
    """Prefill workers whose KV the decode worker can take (same fingerprint), as numbers:
    from the prefix index (leading blocks of the prompt held, blocks held in all; a worker
    absent from `index` holds none of it, and its registry entry says its cache's size), the
    queue from the registry plus what was sent there since."""
    out = []
    for w in workers:
        if w.fingerprint == fingerprint:
            held, size = index.get(w.worker_id) or (0, w.cached_blocks)
            out.append(PrefillCandidate(w.worker_id, held * w.block_size,
                                        w.queued_tokens + assigned_tokens.get(w.worker_id, 0),
                                        w.prefill_tokens_per_s or default_tokens_per_s, size))
    return out


def predicted_prefill_s(c: PrefillCandidate, prompt_tokens: int) -> float:
    """When this worker would have the prompt's first token: queue, then the uncached part."""
    return (c.queued_tokens + max(0, prompt_tokens - c.cached_tokens)) / max(c.tokens_per_s, 1e-9)


def choose_soonest(candidates: list[PrefillCandidate], prompt_tokens: int, recompute_weight: float = 8.0
                   ) -> tuple[PrefillCandidate | None, str]:
    """The candidate with the lowest cost, and why (PD_PREFILL_CHOICE=soonest, the default).
    Cost = predicted first-token time, plus `recompute_weight` x the time spent recomputing
    tokens another worker already holds: that work delays every prompt queued behind it and
    spreads a session's blocks over several caches. (Weight 0 is greedy per request; `make
    eval-router` sweeps it: on the Mooncake trace 4-16 gives both the lowest time to first
    token and most of the oracle's hit rate.) Ties: more cached tokens, then the emptier cache
    (new prefixes spread over the pool instead of piling onto one worker), then the id."""
    if not candidates:
        return None, "no prefill worker"
    most = max([c.cached_tokens for c in candidates])
    # predicted_prefill_s + the recompute penalty, written out (hot: a large pool's every worker, every request)
    rows = [((c.queued_tokens + (prompt_tokens - c.cached_tokens if prompt_tokens > c.cached_tokens else 0)
              + recompute_weight * (most - c.cached_tokens)) / (c.tokens_per_s if c.tokens_per_s > 1e-9 else 1e-9),
             -c.cached_tokens, c.cache_blocks, c.worker_id, c) for c in candidates]
    best = min(rows)[-1]
    return best, (f"{best.worker_id}: first token in ~{predicted_prefill_s(best, prompt_tokens):.2f} s "
                  f"({best.cached_tokens} of {prompt_tokens} tokens cached, {best.queued_tokens} queued)")


def choose_round_robin(candidates: list[PrefillCandidate], turn: int) -> tuple[PrefillCandidate | None, str]:
    """The baseline prefill choice (PD_PREFILL_CHOICE=round_robin), for side-by-side measurements."""
    if not candidates:
        return None, "no prefill worker"
    best = sorted(candidates, key=lambda c: c.worker_id)[turn % len(candidates)]
    return best, f"{best.worker_id}: round-robin"


def within_objective(predicted_s: float, slo_s: float) -> tuple[bool, float, str]:
    """Admission: (admit, retry after s, why). A request whose predicted time to first token
    exceeds the objective is refused now (429 + Retry-After) rather than queued without end;
    it may come back once the excess has drained. slo_s = 0: no objective."""
    if slo_s <= 0 or predicted_s <= slo_s:
        return True, 0.0, ""
    return False, max(1.0, predicted_s - slo_s), (f"predicted time to first token {predicted_s:.1f} s exceeds "
                                                  f"the {slo_s:g} s objective")


def local_or_remote(prompt_tokens: int, decode_cached_tokens: int, decode_running: int, decode_tokens_per_s: float,
                    remote: PrefillCandidate | None, stall_weight: float = 1.0, queue_factor: float = 4.0,
                    handoff_s: float = 0.01) -> tuple[Mode, str]:
    """Prefill on the decode worker, or in the pool (PD_PLACEMENT=cheapest, the default).

    The pool takes a prompt that would wait there behind at most `queue_factor` x its own
    work and of which it holds as much as the decode worker does: that is its job. Otherwise
    (the prompt would queue behind a long one, or the decode worker holds more of it: a
    follow-up turn) the cheaper side takes it. Local: the uncached part at the decode
    worker's rate, plus the stall it causes: every running stream waits through it (its
    tokens share those passes), weighted by `stall_weight` per stream. Remote: the prefill
    worker's predicted first-token time (its queue, then the part it does not hold) plus the
    handoff (the KV streams during the prefill; what is left is a few ms). So a short prompt
    arriving behind a long one is prefilled beside the decode worker's streams instead of
    waiting for it."""
    if remote is None:
        return "local", "no prefill worker available"
    remote_s = predicted_prefill_s(remote, prompt_tokens) + handoff_s
    own = max(1, prompt_tokens - remote.cached_tokens)
    if remote.queued_tokens <= queue_factor * own and remote.cached_tokens >= decode_cached_tokens:
        return "remote", f"prefill pool: {remote.queued_tokens} tokens queued before its {own} ({remote_s:.3f} s)"
    compute = max(0, prompt_tokens - decode_cached_tokens) / max(decode_tokens_per_s, 1e-9)
    local_s = compute * (1 + stall_weight * decode_running)
    if local_s < remote_s:
        return "local", (f"local {local_s:.3f} s ({decode_running} streams stalled {compute:.3f} s) < "
                         f"remote {remote_s:.3f} s")
    return "remote", f"remote {remote_s:.3f} s <= local {local_s:.3f} s ({decode_running} streams)"
