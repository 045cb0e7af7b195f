"""Which sequences run in the next forward pass (continuous batching, chunked prefill).

A pass holds one token for every running sequence (decode) and prompt chunks of waiting
sequences in `prefill_order`, long prompts split into `prefill_chunk`-token pieces, so a short
prompt shares the next pass with long ones instead of waiting for all of them. With
`mixed_batches` (the default, as vLLM and Sarathi-Serve do) both go in the same pass, decode
tokens first, prompt chunks in what is left of `max_batched_tokens`: a long prompt delays
running streams by the cost of one chunk in their own step. Without it, a pass is either
prefill or decode and the two alternate when both are pending (a stream then waits a whole
prefill pass and its own step). When a decode step has no block for a sequence, the newest
running sequence is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed (mostly from the prefix cache) later. A sequence whose grammar is still
compiling is held (`held`: in no pass; a prompt takes no blocks) until `release`, as vLLM's
WAITING_FOR_FSM: the others keep stepping meanwhile. A sequence whose request was charged a crash
runs its first passes alone (`runs_alone`: pdserve/shared/quarantine.py): one such sequence's pass and
one of the others take turns, so neither kind waits more than a pass for the other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable, Sized
from dataclasses import dataclass, field
from itertools import groupby
from typing import Protocol, TypeVar

from pdserve.shared import quarantine
from pdserve.shared.engine.block_manager import BlockManager, OutOfBlocks
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.sequence import Sequence, Status
from pdserve.shared.engine.speculative import Speculator


@dataclass
class Schedule:
    chunks: list[tuple[Sequence, int]]  # (sequence, number of new tokens this pass): decode ones first
    num_decode: int = 0                 # the first num_decode chunks are decode tokens (one each)
    preempted: list[Sequence] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # each decode chunk's draft (speculative.py), or none

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.chunks[self.num_decode:])

    @property
    def decode_rows(self) -> int:
        """The pass's decode rows: one a decode sequence, and one a draft token."""
        return self.num_decode + sum(map(len, self.drafts))


class _Params(Protocol):
    @property
    def priority(self) -> int: ...

    @property
    def tenant(self) -> str: ...


class Prompt(Protocol):
    """What the pass rules read of a waiting prompt (a Sequence; the planner's simulator,
    planner/, passes its own)."""

    num_computed: int

    @property
    def token_ids(self) -> Sized: ...

    @property
    def params(self) -> _Params: ...


Q = TypeVar("Q", bound=Prompt)


def prefill_order(waiting: Iterable[Q], chunk: int) -> list[Q]:
    """The order in which waiting prompts take a prefill pass's token budget.

    Lower `priority` value first. Within a level: the oldest long prompt (more than one chunk
    left), which so advances by a chunk every pass and never starves; then the short ones,
    which finish in this pass instead of queueing behind every long one; then the other long
    ones. First come first within each tier. Then round-robin across tenants: each tenant's
    first prompt in that order, then each one's second..., so a tenant with many prompts
    waiting delays another's by one prompt each, not by all of them."""
    queue = list(waiting)
    if len(queue) < 2:
        return queue
    order: list[Q] = []
    for _, tier in groupby(sorted(queue, key=_priority), key=_priority):
        level = list(tier)
        long = [q for q in level if len(q.token_ids) - q.num_computed > chunk]
        order += _round_robin(long[:1] + [q for q in level if q not in long] + long[1:])
    return order


def _round_robin(level: list[Q]) -> list[Q]:
    """`level` interleaved across tenants, each tenant's prompts in their order."""
    taken: dict[str, int] = {}
    ranks = []
    for i, q in enumerate(level):
        rank = taken.get(q.params.tenant, 0)
        taken[q.params.tenant] = rank + 1
        ranks.append((rank, i))
    return [level[i] for _, i in sorted(ranks)]


def _priority(q: Prompt) -> int:
    return q.params.priority


def runs_alone(seq: Sequence) -> bool:
    """Its next pass holds it alone (quarantine.runs_alone, with the tokens generated here: those
    past the ones it came with)."""
    return quarantine.runs_alone(seq.crashes, len(seq.token_ids) - seq.num_prefill)


def prefill_next(waiting: bool, running: bool, last_was_decode: bool) -> bool:
    """Without mixed batches: is the next pass a prefill pass? When prompts wait and sequences
    run, the two kinds alternate; a prompt alone is prefilled at once."""
    return waiting and (not running or last_was_decode)


def mixed_budget(max_batched_tokens: int, decode_tokens: int) -> int:
    """A mixed pass's token budget left for prompt chunks once every running sequence has its
    decode token (as vLLM's: the pass's tokens, decode and prefill, within max_batched_tokens)."""
    return max(0, max_batched_tokens - decode_tokens)


def prefill_chunks(order: Iterable[Q], running: int, max_num_seqs: int, budget: int, chunk: int,
                   admit: Callable[[Q], bool]) -> list[tuple[Q, int]]:
    """A prefill pass: prompts in `order` take the pass's token `budget`, each at most `chunk`
    tokens, while the batch (`running` sequences and these) stays within `max_num_seqs`.
    `admit(q)` gives a prompt its blocks if it has none yet (False: no room, and the prompts
    after it wait too, in order)."""
    chunks: list[tuple[Q, int]] = []
    for q in order:
        if running + len(chunks) >= max_num_seqs or budget == 0 or not admit(q):
            break
        n = min(len(q.token_ids) - q.num_computed, chunk, budget)
        chunks.append((q, n))
        budget -= n
    return chunks


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager):
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: list[Sequence] = []  # waiting or running, their grammar compiling: in no pass
        self._last_was_decode = True
        self._alone_last = False  # the last pass was a sequence's alone
        self.num_preemptions = 0
        self.speculator: Speculator | None = None  # drafts for the decode sequences (set by the engine)
        self.prompt_budget: Callable[[int], int | None] | None = None  # pass_time.py (set by the engine)

    def add(self, seq: Sequence, held: bool = False) -> None:
        seq.status = Status.WAITING
        (self.held if held else self.waiting).append(seq)

    def join_running(self, seq: Sequence, held: bool = False) -> None:
        seq.status = Status.RUNNING
        (self.held if held else self.running).append(seq)

    def release(self, seq: Sequence) -> None:
        """A held sequence joins the queue it was added to (its grammar is ready)."""
        self.held.remove(seq)
        if seq.status is Status.RUNNING:
            self.running.append(seq)
        else:
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.running, self.held):
            if seq in queue:
                queue.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    def schedule(self) -> Schedule | None:
        """The next pass: a pass of the others (decode tokens, prompt chunks), or one sequence that
        runs alone; the two take turns while both can run."""
        alone = [s for s in (*self.running, *self.waiting) if runs_alone(s)]
        for alone_turn in (False, True) if self._alone_last else (True, False):
            sched = self._schedule_alone(alone) if alone_turn else self._schedule_shared(
                [s for s in self.waiting if not runs_alone(s)] if alone else self.waiting,
                [s for s in self.running if not runs_alone(s)] if alone else self.running)
            if sched is not None:
                self._alone_last = alone_turn
                return sched
        return None

    def _schedule_shared(self, waiting: Collection[Sequence], running: list[Sequence]) -> Schedule | None:
        if self.cfg.mixed_batches:
            sched = self._schedule_decode(running) if running else Schedule([])
            if waiting:
                budget = mixed_budget(self.cfg.max_batched_tokens, sched.decode_rows)
                bound = self.prompt_budget(sched.decode_rows) if self.prompt_budget is not None else None
                sched.chunks += self._schedule_prefill(budget if bound is None else min(budget, bound), waiting).chunks
            return sched if sched.chunks or sched.preempted else None
        if prefill_next(bool(waiting), bool(running), self._last_was_decode):
            prefill = self._schedule_prefill(self.cfg.max_batched_tokens, waiting)
            if prefill.chunks:
                self._last_was_decode = False
                return prefill
        if running:
            self._last_was_decode = True
            return self._schedule_decode(running)
        return None

    def _schedule_alone(self, alone: list[Sequence]) -> Schedule | None:
        """A pass of the first of `alone` that can run now (running ones first: its decode token,
        or its prompt's next chunk)."""
        for seq in alone:
            sched = self._schedule_decode([seq]) if seq.status is Status.RUNNING else \
                self._schedule_prefill(self.cfg.max_batched_tokens, [seq])
            if sched.chunks or sched.preempted:
                return sched
        return None

    def _schedule_prefill(self, budget: int, waiting: Iterable[Sequence]) -> Schedule:
        def admit(seq: Sequence) -> bool:
            if not seq.block_table:
                # a prompt to be scored is computed whole: its cached blocks would have no logits
                reuse = seq.token_ids if seq.prompt_logprobs is None else []
                try:
                    seq.block_table, seq.num_cached = self.blocks.allocate(reuse, len(seq.token_ids),
                                                                           seq.params.cache_salt)
                except OutOfBlocks:
                    return False
                seq.num_computed = seq.num_cached
            return True
        cfg = self.cfg
        return Schedule(prefill_chunks(prefill_order(waiting, cfg.prefill_chunk), len(self.running),
                                       cfg.max_num_seqs, budget, cfg.prefill_chunk, admit))

    def _schedule_decode(self, running: list[Sequence]) -> Schedule:
        """Each of `running`'s decode token; one without a block preempts the newest running sequence. Then
        their drafts (speculative.py), which preempt nothing."""
        preempted: list[Sequence] = []
        batch: list[Sequence] = []
        for seq in list(running):
            if seq in preempted:
                continue
            while True:
                try:
                    self.blocks.append_slot(seq.block_table, len(seq.token_ids))
                    batch.append(seq)
                    break
                except OutOfBlocks:
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
        sched = Schedule([(s, 1) for s in batch], len(batch), preempted)
        if self.speculator is not None and batch:  # drafts in what the decode tokens leave of the pass
            sched.drafts = self.speculator.drafts(batch, self.cfg.max_batched_tokens - len(batch), self.blocks)
        return sched

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed = seq.num_cached = seq.num_committed_blocks = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
