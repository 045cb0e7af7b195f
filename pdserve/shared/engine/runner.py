"""Turn a Schedule into model inputs (step_buffers.py: made once, one copy to the device a pass), run the
forward pass (a decode pass as a CUDA graph where one takes it: cuda_graphs.py), choose the tokens
(device_sampler.py) and read the prompt-scoring rows back; owns the KV pool tensor (on CUDA with graphs one
block more than the engine hands out: the scratch block their padding rows write)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.shared.engine.batch import ForwardBatch
from pdserve.shared.engine.config import EngineConfig, ModelConfig
from pdserve.shared.engine.cuda_graphs import DecodeGraphs, wanted
from pdserve.shared.engine.device_sampler import DeviceSampler
from pdserve.shared.engine.fake import FakeModel
from pdserve.shared.engine.kernels import select
from pdserve.shared.engine.logprobs import Logprob, logprobs_of
from pdserve.shared.engine.model import DecoderModel
from pdserve.shared.engine.scheduler import Schedule
from pdserve.shared.engine.sequence import Sequence
from pdserve.shared.engine.speculative import rows
from pdserve.shared.engine.step_buffers import StepBuffers


class ModelRunner:
    def __init__(self, model: DecoderModel | FakeModel, mcfg: ModelConfig, cfg: EngineConfig, num_blocks: int):
        self.model, self.mcfg, self.cfg = model, mcfg, cfg
        self.device = torch.device(cfg.device)
        use_device(self.device)
        self.ops = select(cfg.kernels, cfg.device)
        if self.ops.name == "triton" and cfg.block_size & (cfg.block_size - 1):
            raise ValueError(f"block_size {cfg.block_size}: the Triton kernels (kernels={cfg.kernels!r} on "
                             f"{cfg.device}) need a KV block size that is a power of two")
        graphs = wanted(cfg)  # (then one block more: the scratch block a graph's padding rows write)
        # (layers, num_blocks, 2, block_size, kv_heads, head_dim): one block of one layer is
        # contiguous, K then V
        self.kv = torch.zeros((mcfg.num_layers, num_blocks + graphs, 2, cfg.block_size, mcfg.num_kv_heads,
                               mcfg.head_dim), dtype=cfg.torch_dtype, device=self.device)
        width = min(-(-mcfg.max_position // cfg.block_size), num_blocks)
        self.buffers = StepBuffers(self.device, cfg.max_num_seqs, width, num_blocks if graphs else -1,
                                   cfg.block_size)
        self.graphs = DecodeGraphs(model, self.ops, self.kv, self.buffers, mcfg.vocab_size) if graphs else None
        self.sampler = DeviceSampler(self.device, max(cfg.max_num_seqs, cfg.max_batched_tokens))

    def run(self, sched: Schedule, layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """Forward one scheduled pass; returns logits (n_out, vocab) for the sequences whose
        next token is due (every decode sequence, then prefill sequences whose prompt is done),
        then one row for each of `scored_positions` of each prompt chunk, in chunk order. A decode
        pass that a CUDA graph takes is replayed (cuda_graphs.py): its logits are valid until the next pass."""
        size = None
        if self.graphs is not None:
            size = self.graphs.bucket(sched.decode_rows, len(sched.chunks) > sched.num_decode, layer_hook)
        batch = self._batch(sched, size)
        if self.graphs is not None and size is not None and self.buffers.holds(batch):
            return self.graphs.replay(size, sched.decode_rows)
        return self.model(batch, self.kv, self.ops, layer_hook)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...],
               ahead: list[int] | None = None) -> tuple[list[int], list[Logprob | None]]:
        """Each row's token (sampler.sample's contract), on the device where it can be (device_sampler.py)."""
        return self.sampler.sample(logits, seqs, eos_ids, ahead)

    def _slot(self, seq: Sequence, pos: int) -> int:
        bs = self.cfg.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def _batch(self, sched: Schedule, pad_to: int | None = None) -> ForwardBatch:
        """Decode rows first (a sequence's last token at its last position, then its draft's tokens after it:
        speculative.py), then the prompt chunks. A decode pass takes step_buffers.py's fixed places (`pad_to`
        rows: a graph's bucket); any other, or one too wide for them, one packed upload."""
        seqs = [seq for seq, _ in sched.chunks[:sched.num_decode]]
        drafts = sched.drafts or [[]] * len(seqs)
        decode, ahead = rows(seqs, drafts)  # each row's sequence
        pos: list[int] = [len(s.token_ids) - 1 + j for s, j in zip(decode, ahead)]
        ids: list[int] = [t for s, draft in zip(seqs, drafts) for t in (s.last_token, *draft)]
        slots = [self._slot(s, p) for s, p in zip(decode, pos)]
        prompts = sched.chunks[sched.num_decode:]
        if decode and not prompts:
            batch = self.buffers.decode(ids, pos, slots, [s.block_table for s in decode], pad_to)
            if batch is not None:
                return batch
        out_rows, spans, scored, tables = list(range(len(decode))), [], [], []
        for seq, n in prompts:
            scored += [len(ids) + p - seq.num_computed for p in scored_positions(seq, n)]
            start, end = seq.num_computed, seq.num_computed + n
            spans.append((len(ids) - len(decode), n, end))
            tables.append(seq.block_table[:-(-end // self.cfg.block_size)])
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            slots += [self._slot(seq, p) for p in range(start, end)]
            if end == len(seq.token_ids):
                out_rows.append(len(ids) - 1)
        out_rows += scored
        width = max((len(s.block_table) for s in decode), default=0)
        padded = [t for s in decode for t in s.block_table + [0] * (width - len(s.block_table))]
        lens = [p + 1 for p in pos[:len(decode)]]
        t_ids, t_pos, t_slots, t_out, t_tables, t_lens, *t_chunks = self.buffers.upload(
            [ids, pos, slots, out_rows, padded, lens, *tables])
        return ForwardBatch(t_ids, t_pos, t_slots, t_out, num_decode=len(decode),
                            block_tables=t_tables.view(len(decode), width) if decode else None,
                            context_lens=t_lens if decode else None,
                            chunks=[(*span, table) for span, table in zip(spans, t_chunks)])


def use_device(device: torch.device) -> None:
    """cuda:N becomes the calling thread's current CUDA device (CUDA's is per thread, 0 unless set):
    what Triton launches on and where streams and events are made without a device named."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def blocks_in_memory(mcfg: ModelConfig, cfg: EngineConfig, fraction: float) -> int:
    """KV blocks for a pool on `cfg.device` (CUDA) made now, its weights loaded: this process keeps within
    `fraction` of the device's memory (the pool gets that less what torch holds for it already; the rest is
    left for a pass's activations, CUDA's own and other processes), and the pool within what is free."""
    device = torch.device(cfg.device)
    free, total = torch.cuda.mem_get_info(device)
    room = min(free, int(fraction * total) - torch.cuda.memory_reserved(device))
    blocks = room // cfg.block_bytes(mcfg)
    if blocks < 1:
        raise ValueError(f"no room for a KV pool on {device}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f}, "
                         f"kv_memory_fraction {fraction}; raise it, or set kv_blocks")
    return int(blocks)


def scored_positions(seq: Sequence, n: int) -> range:
    """Positions of a prompt chunk of `n` tokens whose logits score the next prompt token, for a
    sequence gathering prompt log probabilities (the prompt's last position scores the first
    generated token: it is an output row already)."""
    if seq.prompt_logprobs is None:
        return range(0)
    return range(seq.num_computed, min(seq.num_computed + n, seq.num_prompt - 1))


def score_prompts(sched: Schedule, logits: torch.Tensor) -> None:
    """Prompt log probabilities from a pass's extra rows (`ModelRunner.run`), before the
    chunks' num_computed moves on."""
    prompts = sched.chunks[sched.num_decode:]
    row = sched.decode_rows + sum(seq.num_computed + n == len(seq.token_ids) for seq, n in prompts)
    for seq, n in prompts:
        scored = scored_positions(seq, n)
        if len(scored) and seq.prompt_logprobs is not None:
            seq.prompt_logprobs += logprobs_of(logits[row:row + len(scored)],
                                               seq.token_ids[scored.start + 1:scored.stop + 1],
                                               seq.params.prompt_logprobs or 0)
            row += len(scored)
