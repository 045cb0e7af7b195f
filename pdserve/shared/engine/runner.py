"""Turn a Schedule into model inputs, run the forward pass and read its prompt-scoring rows back;
owns the KV pool tensor."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.shared.engine.batch import ForwardBatch
from pdserve.shared.engine.config import EngineConfig, ModelConfig
from pdserve.shared.engine.fake import FakeModel
from pdserve.shared.engine.kernels import select
from pdserve.shared.engine.logprobs import logprobs_of
from pdserve.shared.engine.model import DecoderModel
from pdserve.shared.engine.scheduler import Schedule
from pdserve.shared.engine.sequence import Sequence
from pdserve.shared.engine.speculative import rows


class ModelRunner:
    def __init__(self, model: DecoderModel | FakeModel, mcfg: ModelConfig, cfg: EngineConfig, num_blocks: int):
        self.model, self.mcfg, self.cfg = model, mcfg, cfg
        self.device = torch.device(cfg.device)
        use_device(self.device)
        self.ops = select(cfg.kernels, cfg.device)
        if self.ops.name == "triton" and cfg.block_size & (cfg.block_size - 1):
            raise ValueError(f"block_size {cfg.block_size}: the Triton kernels (kernels={cfg.kernels!r} on "
                             f"{cfg.device}) need a KV block size that is a power of two")
        # (layers, num_blocks, 2, block_size, kv_heads, head_dim): one block of one layer is
        # contiguous, K then V
        self.kv = torch.zeros((mcfg.num_layers, num_blocks, 2, cfg.block_size, mcfg.num_kv_heads,
                               mcfg.head_dim), dtype=cfg.torch_dtype, device=self.device)

    def run(self, sched: Schedule, layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """Forward one scheduled pass; returns logits (n_out, vocab) for the sequences whose
        next token is due (every decode sequence, then prefill sequences whose prompt is done),
        then one row for each of `scored_positions` of each prompt chunk, in chunk order."""
        return self.model(self._batch(sched), self.kv, self.ops, layer_hook)

    def _slot(self, seq: Sequence, pos: int) -> int:
        bs = self.cfg.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def _tensor(self, data: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def _batch(self, sched: Schedule) -> ForwardBatch:
        """Decode rows first (a sequence's last token at its last position, then its draft's tokens after it:
        speculative.py), then the prompt chunks."""
        seqs = [seq for seq, _ in sched.chunks[:sched.num_decode]]
        drafts = sched.drafts or [[]] * len(seqs)
        decode, ahead = rows(seqs, drafts)  # each row's sequence
        pos: list[int] = [len(s.token_ids) - 1 + j for s, j in zip(decode, ahead)]
        ids: list[int] = [t for s, draft in zip(seqs, drafts) for t in (s.last_token, *draft)]
        slots = [self._slot(s, p) for s, p in zip(decode, pos)]
        out_rows, meta, scored = list(range(len(decode))), [], []
        for seq, n in sched.chunks[sched.num_decode:]:
            scored += [len(ids) + p - seq.num_computed for p in scored_positions(seq, n)]
            start, end = seq.num_computed, seq.num_computed + n
            meta.append((len(ids) - len(decode), n, end,
                         self._tensor(seq.block_table[:-(-end // self.cfg.block_size)])))
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            slots += [self._slot(seq, p) for p in range(start, end)]
            if end == len(seq.token_ids):
                out_rows.append(len(ids) - 1)
        out_rows += scored
        tables = lens = None
        if decode:
            width = max(len(s.block_table) for s in decode)
            tables = self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in decode])
            lens = self._tensor([p + 1 for p in pos[:len(decode)]])
        return ForwardBatch(self._tensor(ids), self._tensor(pos), self._tensor(slots), self._tensor(out_rows),
                            num_decode=len(decode), block_tables=tables, context_lens=lens, chunks=meta)


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
