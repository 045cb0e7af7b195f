"""Speculative decoding: a running sequence's next tokens guessed (drafted), then checked in one decode pass with
the other sequences' tokens.

A `Drafter` proposes up to k tokens that may follow each sequence. `PromptLookup`, the one here, looks for the most
recent earlier occurrence of the sequence's last n tokens (n from 3 down to 1) in its prompt and output and proposes
the k tokens that followed it: no model, a few microseconds, and right where the output copies its input (editing
code, quoting a document). The pass computes the sequence's last token and its draft as 1 + k decode rows at
positions len-1 .. len-1+k over the sequence's blocks, each row attending up to itself (every row's KV is written
before any row attends: runner.py, attention.c), so a row's logits are the ones the sequence would have there had
the draft before it been generated. Each row's token is chosen as the sampler chooses without speculation (the same
logit changes, the same seeded draw: token n from H(seed, n)); the draft is kept up to the first row whose choice
differs from it, and that row's choice comes with it (the bonus token when the whole draft is kept). Where a row's
logits do not depend on its batch (native weights on CPU: weights.py) the tokens are those without speculation, to
the token, greedy or sampled with a seed; a handoff or a failover changes nothing (a draft is a function of the
sequence's tokens).

Under sampling this is rejection sampling with a draft that is a point mass on d (Leviathan et al., q = δ_d): d is
kept with probability min(1, p(d) / q(d)) = p(d) (the draw is d), and otherwise the token is drawn from
max(0, p - q) renormalized, p with d removed (the draw given that it is not d). A drafter that samples its draft
from a distribution of its own (a draft model) needs the general rule with its q; `Drafter.propose` leaves room
for one (a batch of sequences in, a draft each out).

KV: the draft's blocks are taken within the pass's token budget (max_batched_tokens) and the free blocks, never by
preempting; a rejected position's KV lies past the sequence's end, is overwritten when a real token gets there,
and never enters the prefix cache (a block is hashed once its tokens are all computed and kept: engine.py).

Per request: `SamplingParams.speculative_tokens` (None: `EngineConfig.speculative_tokens`; 0: off). With a grammar,
a draft is cut at the first token the grammar refuses, and each row is masked as the grammar stands after the draft
before it (grammar.py: `Matcher.fill_rows`). Off for penalties or a logit bias (they read the tokens before each
row), and while `min_tokens` holds its end back; log probabilities are each row's own, so they stay on.
A draft's length follows the sequence's recent hit rate (`best_length`: the most tokens per pass time, a pass of n
rows costing `pass_cost(n)`); where no length pays, the sequence drafts nothing and keeps guessing without computing
its guesses, and drafts again once they come right (free chat pays little).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pdserve.shared.engine.block_manager import BlockManager, OutOfBlocks
from pdserve.shared.engine.sequence import Sequence

HIT_WEIGHT = 0.15  # a guess's weight in a sequence's hit rate (a moving average over its last ~7)
# a pass of n rows' time, a share of a one-row pass's (index n - 1): SmolLM2 native on CPU, 2 threads (AMD EPYC),
# the file's blocks taken two output rows at a time against 1-3 rows, then a tile of 8 rows (kernels/blocks.c)
PASS_COST = (1.0, 1.42, 1.95, 2.25, 2.35, 2.44, 2.55, 2.69)
TILE_ROW_COST = 0.15  # each row past 8 (a second tile costs less than the first)
MIN_GAIN = 1.1     # a draft is worth its rows where it is expected to give this many tokens per pass time, or more

T = TypeVar("T")


class Drafter(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] tokens that may follow seqs[i] (fewer, or none, where it has no guess)."""
        ...


class PromptLookup:
    """Drafts from the sequence itself: the tokens that followed the most recent earlier occurrence of its last n
    tokens, n from `max_n` down to `min_n` (the longest match that exists)."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [lookup(s.token_ids, k, self.max_n, self.min_n) if k > 0 else [] for s, k in zip(seqs, limits)]


def lookup(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens after the most recent occurrence of `tokens`' last n tokens that ends before its last token,
    for the largest n in [min_n, max_n] that has one; [] where none does. (A search of the tokens' bytes, four to a
    token, in C: a hit that is not on a token's boundary is skipped.)"""
    data = array("i", tokens).tobytes()
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        pattern, end = data[-4 * n:], 4 * (len(tokens) - 1)
        while (at := data.rfind(pattern, 0, end)) >= 0:
            if at % 4 == 0:
                start = at // 4 + n
                return tokens[start:start + k]
            end = at + len(pattern) - 1  # (earlier starts only)
    return []


@dataclass
class SpecStats:
    """What speculation did in an engine: draft tokens computed, of them kept, and passes with a draft."""

    drafted: int = 0
    accepted: int = 0
    passes: int = 0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Speculator:
    """An engine's speculative decoding: which sequences draft and how far, their blocks, and the record of hits."""

    def __init__(self, drafter: Drafter, default_tokens: int, max_position: int):
        self.drafter, self.default_tokens, self.max_position = drafter, default_tokens, max_position
        self.stats = SpecStats()

    def limit(self, seq: Sequence) -> int:
        """The draft tokens `seq` may have this pass: its request's setting (or the engine's), within what it may
        still generate (the bonus token is one) and the context; 0 where speculation is off for it."""
        p = seq.params
        k = self.default_tokens if p.speculative_tokens is None else p.speculative_tokens
        if k <= 0 or seq.pending is not None or p.penalized or seq.num_generated < p.min_tokens:
            return 0
        return max(0, min(k, p.max_tokens - seq.num_generated - 1, self.max_position - len(seq.token_ids)))

    def drafts(self, seqs: list[Sequence], budget: int, blocks: BlockManager) -> list[list[int]]:
        """A draft for each of `seqs` (decode rows beside its token), within `budget` tokens in all and the free
        blocks; a sequence whose guesses have been wrong lately gets none, its guess kept to be scored."""
        limits = [self.limit(s) for s in seqs]
        proposals = self.drafter.propose(seqs, limits) if any(limits) else [[] for _ in seqs]
        drafts: list[list[int]] = []
        for seq, proposal in zip(seqs, proposals):
            seq.drafting.guess = None
            length = best_length(seq.drafting.hit_rate, len(proposal))
            if proposal and not length:
                seq.drafting.guess = proposal[0]
            draft = proposal[:max(0, min(length, budget))]
            if draft and seq.matcher is not None:  # up to the first token its grammar refuses
                draft = draft[:seq.matcher.allows(draft)]
            if draft:
                draft = draft[:_room(seq, len(draft), blocks)]
            if seq.matcher is not None:
                seq.matcher.draft = draft
            budget -= len(draft)
            drafts.append(draft)
        if any(drafts):
            self.stats.passes += 1
        return drafts

    def settle(self, seq: Sequence, draft: list[int], run: list[int]) -> None:
        """Score a sequence's draft (or its guess) against the tokens the pass chose (`run`: the draft's kept
        prefix and one more): each kept token a hit, the first refused one a miss."""
        state = seq.drafting
        if draft:
            kept = len(run) - 1
            self.stats.drafted += len(draft)
            self.stats.accepted += kept
            hits = [1.0] * kept + ([0.0] if kept < len(draft) else [])
        else:
            hits = [] if state.guess is None else [float(run[0] == state.guess)]
            state.guess = None
        for hit in hits:
            state.hit_rate += HIT_WEIGHT * (hit - state.hit_rate)


def pass_cost(rows: int) -> float:
    """A pass of `rows` decode rows' time, a share of a one-row pass's."""
    return PASS_COST[rows - 1] if rows <= len(PASS_COST) else PASS_COST[-1] + TILE_ROW_COST * (rows - len(PASS_COST))


def best_length(hit_rate: float, limit: int) -> int:
    """The draft length up to `limit` expected to give the most tokens per unit of pass time, each draft token kept
    with probability `hit_rate` where the one before it was: (1 + a + ... + a^j) / pass_cost(1 + j); 0 where none
    reaches MIN_GAIN."""
    best, best_gain, expected = 0, MIN_GAIN, 1.0
    for j in range(1, limit + 1):
        expected += hit_rate ** j
        if expected / pass_cost(1 + j) > best_gain:
            best, best_gain = j, expected / pass_cost(1 + j)
    return best


def _room(seq: Sequence, n: int, blocks: BlockManager) -> int:
    """How many of `n` draft positions after `seq`'s last token get a KV slot: all where the free blocks allow,
    else those its blocks hold already."""
    try:
        blocks.append_slot(seq.block_table, len(seq.token_ids) + n)
        return n
    except OutOfBlocks:
        return max(0, min(n, len(seq.block_table) * blocks.block_size - len(seq.token_ids)))


def rows(seqs: list[Sequence], drafts: list[list[int]]) -> tuple[list[Sequence], list[int]]:
    """The pass's output rows in order: each sequence's next token, then one row per draft token; with each row's
    sequence and how many tokens past the sequence's next one it is (the sampler's seed index)."""
    owners: list[Sequence] = []
    ahead: list[int] = []
    for seq, draft in zip(seqs, drafts, strict=True):
        owners += [seq] * (1 + len(draft))
        ahead += range(1 + len(draft))
    return owners, ahead


def runs(chosen: list[T], drafts: list[list[int]], tokens: list[int]) -> list[list[T]]:
    """Split the rows' choices (`chosen`: anything per row, `tokens` the rows' tokens) per sequence: the rows of
    its draft's prefix that the choices agree with, then the first row that differs (or the one after the draft)."""
    out: list[list[T]] = []
    row = 0
    for draft in drafts:
        kept = 0
        while kept < len(draft) and tokens[row + kept] == draft[kept]:
            kept += 1
        out.append(chosen[row:row + kept + 1])
        row += len(draft) + 1
    return out
