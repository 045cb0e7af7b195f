"""The engine: the only interface the services call. No I/O; the only threads it starts are
grammar.py's, compiling requests' grammars while the engine steps the others.

    engine = Engine(loader.load("smollm2"), EngineConfig(num_blocks=512))

Colocated (prefill and decode in one engine):
    engine.add_request(rid, prompt_ids, SamplingParams(...))
    while engine.has_work(): outputs = engine.step()     # RequestOutput per sequence touched
    engine.abort(rid)                                    # at any time; frees its blocks

Prefill side of a disaggregated request:
    engine.add_request(rid, prompt_ids, params, prefill_only=True)
    engine.stream_kv(rid, reservation.first_block, sink)  # sink(KVPiece) once each layer of
                                 # each pass is computed, called on the engine's thread
    engine.step() ...            # until an output for rid arrives: it carries the first token;
                                 # the sequence is then parked, its blocks held
    engine.kv_blocks(rid, layer, first, n)                # again, for a re-send
    engine.free(rid)             # once the decode side has confirmed (or the lease expired)
  (or, not streamed: export = engine.export_kv(rid, first_block) after the prefill)

Decode side:
    reservation = engine.reserve(rid, prompt_ids, params)   # raises OutOfBlocks to refuse
    engine.write_kv(layer, block_ids, data)   # each verified piece into reservation.block_ids
    engine.commit_import(rid, first_token)                  # joins the decode batch
    engine.step() ...                                       # streams the rest

A request with a grammar is held out of the passes until its grammar compiles; one whose
grammar fails (or misses PD_GRAMMAR_COMPILE_TIMEOUT_S) ends with an output that carries the
error. `layer_hook(layer)` is called during each forward pass once that layer's KV is in the pool
(the seam for layer-by-layer transfer). `drain_cache_changes()` returns prefix-cache "stored" /
"evicted" changes for the router's prefix index. The KV read out of the pool and written into
it for a handoff is kv_handoff.py's (`Engine.handoff`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from pdserve.shared.engine import speculative
from pdserve.shared.engine.block_manager import BlockManager, CacheChange, OutOfBlocks
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.detokenizer import TextStream
from pdserve.shared.engine.grammar import GrammarError, Grammars, token_table, wait_any
from pdserve.shared.engine.kv_handoff import KVHandoff
from pdserve.shared.engine.kv_io import KVExport, KVPiece, Reservation
from pdserve.shared.engine.loader import LoadedModel
from pdserve.shared.engine.logprobs import Logprob
from pdserve.shared.engine.pass_time import PassTimes
from pdserve.shared.engine.runner import ModelRunner, score_prompts
from pdserve.shared.engine.scheduler import Scheduler
from pdserve.shared.engine.sequence import SamplingParams, Sequence, Status, finish_reason

log = logging.getLogger(__name__)
HELD_WAIT_S = 0.01  # a step with only held sequences waits this long at most for a grammar


class Pass(NamedTuple):
    """What one step computed: decode tokens (one per running sequence) and prompt tokens."""

    decode_tokens: int
    prefill_tokens: int

    @property
    def kind(self) -> str:
        """decode | prefill | mixed | idle"""
        if self.decode_tokens and self.prefill_tokens:
            return "mixed"
        return "decode" if self.decode_tokens else "prefill" if self.prefill_tokens else "idle"


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str                 # new text since the last output for this request
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int
    logprobs: list[Logprob] | None = None      # each new token's, when its request asks
    prompt_logprobs: list[Logprob | None] | None = None  # with a request's first token, when asked:
                                               # one per prompt token (None for the first)
    error: str | None = None  # why the request ended without its tokens (finish_reason "error")


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig):
        self.cfg = cfg
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.fingerprint = loaded.fingerprint(cfg.torch_dtype, cfg.block_size, cfg.pair_any_weights)
        self.num_blocks = cfg.blocks_for(loaded.config)
        self.blocks = BlockManager(self.num_blocks, cfg.block_size, cfg.enable_prefix_cache)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.speculator = self.scheduler.speculator = speculative.Speculator(
            speculative.PromptLookup(), cfg.speculative_tokens, loaded.config.max_position)
        self.runner = ModelRunner(loaded.model, loaded.config, cfg, self.num_blocks)
        self.pass_times = PassTimes(cfg.pass_target_ms / 1000, cfg.block_size)
        self.scheduler.prompt_budget = self.pass_times.prompt_budget if cfg.pass_target_ms else None
        eos = set(loaded.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.seqs: dict[str, Sequence] = {}
        self.layer_hook = None
        self.before_pass: Callable[[list[Sequence]], None] | None = None  # told each pass's sequences (batches.py)
        self.handoff = KVHandoff(self.runner, self.blocks, self.fingerprint)  # KV out of and into the pool
        self.last_pass = Pass(0, 0)  # what the last step computed
        self._rng = random.Random(cfg.seed)

    @cached_property
    def grammars(self) -> Grammars:
        """Structured output's compiler over this model's vocabulary (built on first use)."""
        if self.tokenizer is None:
            raise GrammarError("this model has no tokenizer: structured output needs one")
        return Grammars(token_table(self.tokenizer, self.model_config.vocab_size), self.eos_token_ids,
                        self.cfg.grammar_compile_threads, self.cfg.grammar_compile_timeout_s,
                        self.cfg.grammar_compiles_per_tenant)

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def drain_cache_changes(self) -> list[CacheChange]:
        return self.blocks.drain_changes()

    def cached_hashes(self) -> list[int]:
        """Every block hash in the prefix cache now (what the drained changes add up to)."""
        return list(self.blocks.hash_to_block)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.blocks.hash_to_block)

    @property
    def num_importing(self) -> int:
        """Sequences reserved for KV on its way: they run as soon as it lands."""
        return sum(s.status is Status.IMPORTING for s in list(self.seqs.values()))

    @property
    def growth_blocks(self) -> int:
        """Blocks the unfinished sequences may still take, each until its max_tokens (a bound:
        most stop earlier). A snapshot: safe from another thread."""
        return sum(max(0, self.blocks.blocks_needed(s.num_prompt + s.params.max_tokens) - len(s.block_table))
                   for s in list(self.seqs.values()) if s.status is not Status.FINISHED)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens queued and not yet computed (a snapshot: safe from another thread)."""
        queued = [*list(self.scheduler.waiting), *list(self.scheduler.held)]
        return sum(len(s.token_ids) - s.num_computed for s in queued if s.status is Status.WAITING)

    # -- colocated / prefill -------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False, generated_token_ids: list[int] | tuple[()] = (),
                    crashes: int = 0) -> None:
        """Queue a request. `generated_token_ids` resumes one that another engine had started
        (failover): they are prefilled with the prompt and count as already generated, so
        max_tokens, seeded sampling and the text stream continue where they stopped. `crashes`:
        those charged to the request so far (its first passes run alone: scheduler.runs_alone)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only, generated_token_ids)
        seq.crashes = crashes
        if params.prompt_logprobs is not None and not generated_token_ids:  # (a failover's were streamed)
            seq.prompt_logprobs = [None]  # the first prompt token has no context to be scored in
        self.scheduler.add(seq, held=seq.pending is not None)

    def step(self) -> list[RequestOutput]:
        ended = self._settle_grammars()
        sched = self.scheduler.schedule()
        if sched is None or not sched.chunks:
            self.last_pass = Pass(0, 0)
            if not ended and self.scheduler.held:  # nothing to compute: until a grammar compiles, briefly
                wait_any([s.pending for s in self.scheduler.held if s.pending is not None], HELD_WAIT_S)
            return ended
        self.last_pass = Pass(sched.num_decode, sched.prefill_tokens)
        if self.before_pass is not None:
            self.before_pass([seq for seq, _ in sched.chunks])
        started = time.perf_counter()
        logits = self.runner.run(sched, self.handoff.layer_hook(sched, self.layer_hook))
        score_prompts(sched, logits)
        due = [seq for seq, _ in sched.chunks[:sched.num_decode]]  # (their KV counted as their tokens are kept)
        for seq, n in sched.chunks[sched.num_decode:]:
            seq.num_computed += n
            self._commit_blocks(seq)
            if seq.num_computed == len(seq.token_ids):
                due.append(seq)
        drafts = sched.drafts + [[]] * (len(due) - len(sched.drafts))
        rows, ahead = speculative.rows(due, drafts)
        tokens, lps = self.runner.sample(logits[:len(rows)], rows, self.eos_token_ids, ahead)
        self.pass_times.observe(sched.decode_rows, sched.prefill_tokens, time.perf_counter() - started)
        outputs = []
        for seq, draft, run in zip(due, drafts, speculative.runs(list(zip(tokens, lps)), drafts, tokens)):
            if seq.status is Status.WAITING:  # prompt done: leave the prefill queue
                self.scheduler.waiting.remove(seq)
                if seq.prefill_only:
                    seq.status = Status.PARKED
                else:
                    self.scheduler.join_running(seq)
                outputs.append(self._append_token(seq, *run[0]))
            else:
                outputs.append(self._append_run(seq, run))
                self.speculator.settle(seq, draft, [token for token, _ in run])
        return ended + outputs

    def abort(self, request_id: str) -> None:
        """Forget a request in any state and free its blocks (no-op if unknown)."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            if seq.status is Status.IMPORTING:  # writes into its blocks may still be queued: before
                self.handoff.join()             # the blocks go to anyone else's pass
            seq.finish_reason = seq.finish_reason or "abort"
            self._finish(seq)

    free = abort  # a parked sequence whose KV the decode side has confirmed

    def stream_kv(self, request_id: str, first_block: int, sink: Callable[[KVPiece], None]) -> None:
        """Hand `sink` each layer of the prompt's blocks from `first_block` on as a pass computes it."""
        self.handoff.stream(self.seqs[request_id], first_block, sink)

    def kv_blocks(self, request_id: str, layer: int, first_block: int, num_blocks: int) -> torch.Tensor:
        """Layer `layer` of prompt blocks [first_block, first_block + num_blocks) (a re-send)."""
        return self.handoff.computed_blocks(self.seqs[request_id], layer, first_block, num_blocks)

    def export_kv(self, request_id: str, first_block: int = 0) -> KVExport:
        """The prompt's KV blocks from `first_block` on, of a parked (prefilled) sequence."""
        return self.handoff.export(self.seqs[request_id], first_block)

    # -- decode side of a transfer ---------------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                generated_token_ids: list[int] | tuple[()] = (), max_seqs: int | None = None) -> Reservation:
        """Set aside blocks for a sequence whose KV will arrive; reuses the local prefix cache.
        `generated_token_ids`: a failover's tokens generated before it, prefilled on the other
        side with the prompt (their KV arrives too; they count as generated here). `max_seqs`:
        the sequences this engine may hold with this one (default max_num_seqs; the caller
        may allow more for a stream moved off a lost worker).

        Raises OutOfBlocks when this engine cannot take it (the router picks another)."""
        limit = self.cfg.max_num_seqs if max_seqs is None else max_seqs
        active = sum(s.status is not Status.FINISHED for s in self.seqs.values())
        if active >= limit:
            raise OutOfBlocks(f"{active} sequences already, at most {limit} here")
        seq = self._new_sequence(request_id, prompt_token_ids, params, False, generated_token_ids)
        try:
            seq.block_table, seq.num_cached = self.blocks.allocate(seq.token_ids, seq.num_prefill,
                                                                   seq.params.cache_salt)
        except OutOfBlocks:
            del self.seqs[request_id]
            if seq.pending is not None:
                seq.pending.abandon()
            raise
        seq.num_computed = seq.num_cached
        seq.status = Status.IMPORTING
        first = seq.num_cached // self.cfg.block_size
        return Reservation(request_id, len(seq.block_table), first, tuple(seq.block_table[first:]))

    def write_kv(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None:
        """Write received blocks (n, 2, bs, kvh, hd), or their bytes, into pool blocks.

        Touches only the pool, never engine state: the caller may run it off the engine thread
        for the blocks of a reservation (no pass reads them before `commit_import`)."""
        self.handoff.write(layer, block_ids, data)

    def import_layer(self, request_id: str, layer: int, buffer: torch.Tensor, first_block: int) -> None:
        """Write one whole layer of an export (KVExport.layer) into a reserved sequence."""
        self.handoff.write_layer(self.seqs[request_id], layer, buffer, first_block)

    def commit_import(self, request_id: str, first_token: int, logprob: Logprob | None = None,
                      prompt_logprobs: list[Logprob | None] | None = None, crashes: int = 0) -> RequestOutput:
        """All layers are in: the sequence joins the decode batch with its first token (and the
        log probabilities the prefill side computed with it, for its output); `crashes` as add_request's."""
        seq = self.seqs[request_id]
        if seq.status is not Status.IMPORTING:
            raise ValueError(f"{request_id}: not reserved for import ({seq.status})")
        seq.crashes = crashes
        self.handoff.join()  # its blocks' writes (on the KV stream) before its first step
        seq.num_computed = seq.num_prefill
        self._commit_blocks(seq)
        self.scheduler.join_running(seq, held=seq.pending is not None)  # (the matcher takes the token once made)
        seq.prompt_logprobs = prompt_logprobs
        return self._append_token(seq, first_token, logprob)  # (the prefill side published it already)

    # -- internals -----------------------------------------------------------------------
    def _new_sequence(self, request_id: str, prompt: list[int], params: SamplingParams,
                      prefill_only: bool, generated: list[int] | tuple[()] = ()) -> Sequence:
        if request_id in self.seqs:
            raise ValueError(f"request {request_id!r} already exists")
        if not prompt:
            raise ValueError("empty prompt")
        limit = self.model_config.max_position
        total = len(prompt) + len(generated)
        if total >= limit:
            raise ValueError(f"prompt of {total} tokens leaves no room in the {limit}-token context")
        if self.blocks.blocks_needed(total + 1) > self.num_blocks:
            raise ValueError(f"prompt of {total} tokens does not fit in the KV pool")
        if len(generated) >= params.max_tokens:
            raise ValueError("nothing left to generate: generated_token_ids reach max_tokens")
        if any(not 0 <= t < self.model_config.vocab_size for t in (*prompt, *generated)):
            raise ValueError("prompt has token ids outside the vocabulary")
        seq = Sequence(request_id, [*prompt, *generated], len(prompt), params, prefill_only=prefill_only,
                       num_prefill=total)
        seq.seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        if params.grammar is not None:
            seq.pending = self.grammars.submit(params.grammar, params.tenant)  # held until ready (_settle_grammars)
        if self.tokenizer is not None:
            seq.text = TextStream(self.tokenizer, len(prompt), params.stop, params.include_stop_str_in_output,
                                  params.skip_special_tokens)
            for end in range(len(prompt) + 1, total + 1):  # already streamed by the engine before
                seq.text.push(seq.token_ids[:end])
        self.seqs[request_id] = seq
        return seq

    def _settle_grammars(self) -> list[RequestOutput]:
        """Held sequences whose grammar compiled join the passes, its matcher past the tokens
        generated before; those whose grammar failed or is past its deadline end with the error."""
        ended = []
        for seq in list(self.scheduler.held):
            pending = seq.pending
            if pending is None or not (pending.ready() or pending.overdue()):
                continue
            try:
                seq.matcher, seq.pending = pending.matcher(seq.token_ids[seq.num_prompt:]), None
            except GrammarError as e:
                log.warning("%s: %s", seq.request_id, e)
                seq.finish_reason = "error"
                self._finish(seq)
                ended.append(RequestOutput(seq.request_id, [], "", True, "error", seq.num_prompt,
                                           seq.num_generated, seq.num_cached, error=str(e)))
                continue
            self.scheduler.release(seq)
        return ended

    def _commit_blocks(self, seq: Sequence) -> None:
        """Index blocks that became full since the last call (their KV is final)."""
        full = seq.num_computed // self.cfg.block_size
        if full > seq.num_committed_blocks:
            hashes = seq.full_block_hashes(self.cfg.block_size, seq.num_computed)
            done = seq.num_committed_blocks
            self.blocks.commit_full_blocks(seq.block_table[done:full], hashes[done:full])
            seq.num_committed_blocks = full

    def _append_run(self, seq: Sequence, run: list[tuple[int, Logprob | None]]) -> RequestOutput:
        """A decode sequence's tokens of one pass (one, or a draft's kept tokens and one more), each as one decode
        step would take it (its KV before it counted and committed), up to the first that ends the sequence."""
        outs = []
        for token, lp in run:
            seq.num_computed += 1
            self._commit_blocks(seq)
            outs.append(self._append_token(seq, token, lp))
            if outs[-1].finished:
                break
        if len(outs) == 1:
            return outs[0]
        last, lps = outs[-1], [lp for o in outs for lp in o.logprobs or ()]
        return RequestOutput(seq.request_id, [t for o in outs for t in o.new_token_ids], "".join(o.text for o in outs),
                             last.finished, last.finish_reason, last.num_prompt_tokens, last.num_generated_tokens,
                             last.num_cached_tokens, lps or None)

    def _append_token(self, seq: Sequence, token: int, logprob: Logprob | None = None) -> RequestOutput:
        prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None  # handed out once
        if seq.matcher is not None and not seq.matcher.accept(token):  # (chosen under its mask: a bug)
            log.error("%s: token %d leaves the request's grammar", seq.request_id, token)
        seq.token_ids.append(token)
        text = seq.text.push(seq.token_ids) if seq.text is not None else ""
        reason = finish_reason(seq, token, self.eos_token_ids, self.model_config.max_position)
        if reason is not None:
            seq.finish_reason = reason
            if seq.text is not None:
                text += seq.text.flush()
            self._finish(seq)
        return RequestOutput(seq.request_id, [token], text, reason is not None, reason,
                             seq.num_prompt, seq.num_generated, seq.num_cached,
                             None if logprob is None else [logprob], prompt_logprobs)

    def _finish(self, seq: Sequence) -> None:
        if seq.pending is not None:
            seq.pending.abandon()
        self.handoff.forget(seq.request_id)
        self.scheduler.remove(seq)
        self.blocks.free(seq.block_table)
        seq.status = Status.FINISHED
        del self.seqs[seq.request_id]

