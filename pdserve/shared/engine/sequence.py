"""One request inside the engine: its tokens, its blocks, its sampling settings and its state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.shared.engine.detokenizer import TextStream
from pdserve.shared.engine.grammar import Grammar, Matcher, Pending
from pdserve.shared.hashing import block_hash, root_hash


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0      # 0 (below MIN_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    seed: int | None = None       # per-request: same seed, same tokens, wherever they are sampled
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int = 0             # lower is sooner in the prefill queue (ties: first come)
    presence_penalty: float = 0.0   # minus this from a token's logit once it has been generated (OpenAI)
    frequency_penalty: float = 0.0  # minus this x how often it has been generated (OpenAI)
    repetition_penalty: float = 1.0  # a token in the prompt or the output: logit / this if > 0, else x this
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    min_p: float = 0.0            # drop tokens less likely than this x the most likely one
    logprobs: int | None = None   # each generated token's log probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token (after the first)
    grammar: Grammar | None = None  # what the output must spell (structured output)
    cache_salt: str = ""          # prefix-cache partition: blocks are shared only under one salt (hashing.py)
    tenant: str = ""              # who asked: a priority level's prompts are taken round-robin across tenants
    include_stop_str_in_output: bool = False  # the stop string that ended the text kept at its end
    skip_special_tokens: bool = True          # special tokens left out of the text (their ids are kept)
    speculative_tokens: int | None = None     # draft tokens checked per step (speculative.py); 0 off, None the engine's

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if any(k is not None and k < 0 for k in (self.logprobs, self.prompt_logprobs)):
            raise ValueError("logprobs and prompt_logprobs must be >= 0")
        if self.speculative_tokens is not None and not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must be between 0 and {MAX_SPECULATIVE_TOKENS}")

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before the choice (penalties, biases)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Below MIN_TEMPERATURE the distribution is argmax anyway, and dividing logits by it
        would overflow to inf (NaN probabilities)."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


MIN_TEMPERATURE = 1e-5
MAX_SPECULATIVE_TOKENS = 16  # a request's draft length at most


@dataclass
class Drafting:
    """A sequence's record under speculative decoding (speculative.py)."""

    hit_rate: float = 1.0    # the share of its recent draft tokens (or guesses) that were right, a moving average
    guess: int | None = None  # its next token as guessed while it drafts nothing (scored, never computed)


class Status(enum.Enum):
    WAITING = "waiting"        # needs (more) prefill
    RUNNING = "running"        # in the decode batch
    PARKED = "parked"          # prefill done, blocks held for export (prefill-only requests)
    IMPORTING = "importing"    # blocks reserved, KV arriving from a prefill engine
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt: int
    params: SamplingParams
    prefill_only: bool = False
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0          # tokens whose KV is in the cache
    num_cached: int = 0            # of those, taken from the prefix cache at admission
    finish_reason: str | None = None
    text: TextStream | None = None
    seed: int = 0                  # params.seed, or drawn by the engine when unset
    hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks, grown as they fill
    num_committed_blocks: int = 0  # leading blocks already entered in the prefix index
    # tokens known at admission: the prompt and, after a failover, the tokens generated before
    # it; they are prefilled together, and their KV is what crosses the boundary
    num_prefill: int = 0
    # params.prompt_logprobs: each prompt token's Logprob (None for the first), gathered pass by
    # pass and handed out with the first generated token
    prompt_logprobs: list | None = None
    matcher: Matcher | None = None  # params.grammar's state: advanced by every token generated
    pending: Pending | None = None  # params.grammar while it compiles (no matcher yet: the sequence is held)
    crashes: int = 0                # crashes charged to its request before it came here: its first passes
                                    # run alone (pdserve/shared/quarantine.py)
    drafting: Drafting = field(default_factory=Drafting)

    def full_block_hashes(self, block_size: int, num_tokens: int) -> list[int]:
        """Hashes of the full blocks among the first `num_tokens` (each computed once)."""
        for i in range(len(self.hashes), num_tokens // block_size):
            parent = self.hashes[-1] if self.hashes else root_hash(self.params.cache_salt)
            self.hashes.append(block_hash(parent, self.token_ids[i * block_size:(i + 1) * block_size]))
        return self.hashes[:num_tokens // block_size]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]


def finish_reason(seq: Sequence, token: int, eos_token_ids: tuple[int, ...], max_position: int) -> str | None:
    """Why `seq` stops with `token` just appended ("stop" | "length"), or None: it goes on."""
    p = seq.params
    can_stop = seq.num_generated >= p.min_tokens
    if can_stop and ((token in eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids):
        return "stop"
    if can_stop and seq.text is not None and seq.text.stopped:
        return "stop"
    if seq.num_generated >= p.max_tokens or len(seq.token_ids) >= max_position:
        return "length"
    return None
