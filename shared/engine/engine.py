"""The engine: the only interface the services call. No I/O, no threads, no clocks.

    engine = Engine(loader.load("smollm2"), EngineConfig(num_blocks=512))

Colocated (prefill and decode in one engine):
    engine.add_request(rid, prompt_ids, SamplingParams(...))
    while engine.has_work(): outputs = engine.step()     # RequestOutput per sequence touched
    engine.abort(rid)                                    # at any time; frees its blocks

Prefill side of a disaggregated request:
    engine.add_request(rid, prompt_ids, params, prefill_only=True)
    engine.step() ...            # until an output for rid arrives: it carries the first token;
                                 # the sequence is then parked, its blocks held
    export = engine.export_kv(rid, first_block=reservation.first_block)
    ... send export.layer_bytes(i) for every layer ...
    engine.free(rid)             # once the decode side has confirmed (or the lease expired)

Decode side:
    reservation = engine.reserve(rid, prompt_ids, params)   # raises OutOfBlocks to refuse
    engine.import_layer(rid, layer, buffer, reservation.first_block)  # for every layer
    engine.commit_import(rid, first_token)                  # joins the decode batch
    engine.step() ...                                       # streams the rest

`layer_hook(layer)` is called during each forward pass once that layer's KV is in the pool
(the seam for layer-by-layer transfer). `drain_kv_events()` returns prefix-cache "stored" /
"evicted" events for the router's prefix index.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from shared.engine.block_manager import BlockManager, KVEvent, OutOfBlocks
from shared.engine.config import EngineConfig
from shared.engine.detokenizer import TextStream
from shared.engine.kv_io import KVExport, Reservation
from shared.engine.loader import LoadedModel
from shared.engine.runner import ModelRunner
from shared.engine.sampler import sample
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import SamplingParams, Sequence, Status


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


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig):
        self.cfg = cfg
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.fingerprint = loaded.fingerprint(cfg.torch_dtype, cfg.block_size)
        self.num_blocks = cfg.blocks_for(loaded.config)
        self.blocks = BlockManager(self.num_blocks, cfg.block_size, cfg.enable_prefix_cache)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.runner = ModelRunner(loaded.model, loaded.config, cfg, self.num_blocks)
        eos = set(loaded.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.seqs: dict[str, Sequence] = {}
        self.layer_hook = None
        self._rng = random.Random(cfg.seed)

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def drain_kv_events(self) -> list[KVEvent]:
        return self.blocks.drain_events()

    # -- colocated / prefill -------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False, generated_token_ids: list[int] = ()) -> None:
        """Queue a request. `generated_token_ids` resumes one that another engine had started
        (failover): they are prefilled with the prompt and count as already generated, so
        max_tokens, seeded sampling and the text stream continue where they stopped."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only, generated_token_ids)
        self.scheduler.add(seq)

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched is None:
            return []
        logits = self.runner.run(sched, self.layer_hook)
        due: list[Sequence] = []
        for seq, n in sched.chunks:
            seq.num_computed += n
            self._commit_blocks(seq)
            if seq.num_computed == len(seq.token_ids):
                due.append(seq)
        outputs = []
        for seq, token in zip(due, sample(logits, due, self.eos_token_ids)):
            if seq.status is Status.WAITING:  # prompt done: leave the prefill queue
                self.scheduler.waiting.remove(seq)
                if seq.prefill_only:
                    seq.status = Status.PARKED
                else:
                    self.scheduler.join_running(seq)
            outputs.append(self._append_token(seq, token))
        return outputs

    def abort(self, request_id: str) -> None:
        """Forget a request in any state and free its blocks (no-op if unknown)."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            seq.finish_reason = seq.finish_reason or "abort"
            self._finish(seq)

    free = abort  # a parked sequence whose KV the decode side has confirmed

    def export_kv(self, request_id: str, first_block: int = 0) -> KVExport:
        """The prompt's KV blocks from `first_block` on, of a parked (prefilled) sequence."""
        seq = self.seqs[request_id]
        if seq.status is not Status.PARKED:
            raise ValueError(f"{request_id}: only a parked sequence can be exported ({seq.status})")
        prompt = seq.token_ids[:seq.num_prompt]
        table = seq.block_table[:self.blocks.blocks_needed(seq.num_prompt)]
        hashes = seq.full_block_hashes(self.cfg.block_size, seq.num_prompt)
        ids = torch.tensor(table[first_block:], dtype=torch.long, device=self.runner.device)
        gather = lambda layer: self.runner.ops.gather_blocks(self.runner.kv[layer], ids)  # noqa: E731
        return KVExport(request_id, self.fingerprint, prompt, hashes,
                        first_block, len(table) - first_block, self.model_config.num_layers, gather)

    # -- decode side of a transfer ---------------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Reservation:
        """Set aside blocks for a sequence whose KV will arrive; reuses the local prefix cache.

        Raises OutOfBlocks when this engine cannot take it (the router picks another)."""
        active = sum(s.status is not Status.FINISHED for s in self.seqs.values())
        if active >= self.cfg.max_num_seqs:
            raise OutOfBlocks(f"{active} sequences already at max_num_seqs")
        seq = self._new_sequence(request_id, prompt_token_ids, params, False)
        try:
            seq.block_table, seq.num_cached = self.blocks.allocate(seq.token_ids, seq.num_prompt)
        except OutOfBlocks:
            del self.seqs[request_id]
            raise
        seq.num_computed = seq.num_cached
        seq.status = Status.IMPORTING
        return Reservation(request_id, len(seq.block_table), seq.num_cached // self.cfg.block_size)

    def import_layer(self, request_id: str, layer: int, buffer: torch.Tensor, first_block: int) -> None:
        """Write one layer of received blocks (n, 2, bs, kvh, hd) or its bytes into the pool."""
        seq = self.seqs[request_id]
        if seq.status is not Status.IMPORTING:
            raise ValueError(f"{request_id}: not reserved for import ({seq.status})")
        pool = self.runner.kv[layer]
        data = buffer.to(self.runner.device)
        data = data.view(pool.dtype) if data.dtype == torch.uint8 else data
        data = data.view(-1, *pool.shape[1:])
        ids = torch.tensor(seq.block_table[first_block:first_block + data.shape[0]], dtype=torch.long,
                           device=self.runner.device)
        if ids.numel() != data.shape[0]:
            raise ValueError(f"{request_id}: {data.shape[0]} blocks received, {ids.numel()} reserved")
        self.runner.ops.scatter_blocks(pool, ids, data)

    def commit_import(self, request_id: str, first_token: int) -> RequestOutput:
        """All layers are in: the sequence joins the decode batch with its first token."""
        seq = self.seqs[request_id]
        if seq.status is not Status.IMPORTING:
            raise ValueError(f"{request_id}: not reserved for import ({seq.status})")
        seq.num_computed = seq.num_prompt
        self._commit_blocks(seq)
        self.scheduler.join_running(seq)
        out = self._append_token(seq, first_token)
        out.text = ""  # the prefill side already emitted the first token's text
        return out

    # -- internals -----------------------------------------------------------------------
    def _new_sequence(self, request_id: str, prompt: list[int], params: SamplingParams,
                      prefill_only: bool, generated: list[int] = ()) -> Sequence:
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
        seq = Sequence(request_id, [*prompt, *generated], len(prompt), params, prefill_only=prefill_only)
        seq.seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        if self.tokenizer is not None:
            seq.text = TextStream(self.tokenizer, len(prompt), params.stop)
            for end in range(len(prompt) + 1, total + 1):  # already streamed by the engine before
                seq.text.push(seq.token_ids[:end])
        self.seqs[request_id] = seq
        return seq

    def _commit_blocks(self, seq: Sequence) -> None:
        """Index blocks that became full since the last call (their KV is final)."""
        full = seq.num_computed // self.cfg.block_size
        if full > seq.num_committed_blocks:
            hashes = seq.full_block_hashes(self.cfg.block_size, seq.num_computed)
            done = seq.num_committed_blocks
            self.blocks.commit_full_blocks(seq.block_table[done:full], hashes[done:full])
            seq.num_committed_blocks = full

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
        seq.token_ids.append(token)
        text = seq.text.push(seq.token_ids) if seq.text is not None else ""
        reason = self._finish_reason(seq, token)
        if reason is not None:
            seq.finish_reason = reason
            if seq.text is not None:
                text += seq.text.flush()
            self._finish(seq)
        return RequestOutput(seq.request_id, [token], text, reason is not None, reason,
                             seq.num_prompt, seq.num_generated, seq.num_cached)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        can_stop = seq.num_generated >= p.min_tokens
        if can_stop and ((token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids):
            return "stop"
        if can_stop and seq.text is not None and seq.text.stopped:
            return "stop"
        if seq.num_generated >= p.max_tokens or len(seq.token_ids) >= self.model_config.max_position:
            return "length"
        return None

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self.blocks.free(seq.block_table)
        seq.status = Status.FINISHED
        del self.seqs[seq.request_id]
