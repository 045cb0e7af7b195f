"""The fake model: a stand-in for the tests of routing, failover, cancellation and the bus
(`PD_MODEL=fake:smollm2`), never the default and never a fallback. It loads in a fraction of a
second, holds no weights, and behind the real Engine (scheduler, block manager, prefix cache,
KV handoff) computes a pass in microseconds, with an optional sleep per pass (PD_FAKE_STEP_S)
for a step time. Its tokens are no model's: the tests that check numbers keep the real one.

What it keeps of the real model: its base's tokenizer and chat template (the gateway works
unchanged) and the KV pool's shape (SmolLM2's layers, KV heads and head size: the handoff moves
as many bytes). Every token's KV holds a digest of the sequence up to it (three bytes, exact in
float32, bfloat16 and float16), computed from the previous token's KV in the pool, so a
token's digest is a function of the whole prefix and the KV is really read: a cached, imported
or re-prefilled prefix gives the same digests, a wrong one other tokens. The next token is a
word token picked by the digest: greedy decoding is deterministic and a failover that resumes
a stream continues it with the same tokens; sampling spreads over a few next words (a seed
reproduces it); end of sequence never comes unless a grammar leaves nothing else.
"""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import torch

from pdserve.shared.engine.batch import ForwardBatch, LayerHook
from pdserve.shared.engine.config import ModelConfig
from pdserve.shared.engine.kernels.torch_ref import kv_rows, write_kv
from pdserve.shared.engine.tokenizer import Tokenizer

MODULUS = 16_777_213           # digests are below 2**24: three bytes
START = 7                      # the digest before a sequence's first token
SPREAD = 8                     # the words a digest gives a score to (sampling picks among them)
FLOOR = -20.0                  # every other token's logit
WORD = re.compile(r"^Ġ[a-z]{3,}$")   # a byte-level piece: a space, then a lowercase word

def digest(before: int, token: int) -> int:
    return (before * 31 + token + 1) % MODULUS


class FakeModel:
    """The forward pass DecoderModel's callers make (ModelRunner.run), over the same KV pool."""

    def __init__(self, cfg: ModelConfig, tokenizer: Tokenizer, step_s: float = 0.0):
        self.cfg, self.step_s = cfg, step_s
        vocab = tokenizer.tok.get_vocab()
        self.words = torch.tensor(sorted(i for piece, i in vocab.items() if WORD.match(piece) and i < cfg.vocab_size))

    def __call__(self, batch: ForwardBatch, kv_pools: torch.Tensor, ops: SimpleNamespace,
                 layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Next-token logits (B_out, vocab) in fp32 for `batch.logits_index`, each token's KV
        written into every layer's pool first (the hook called after each layer)."""
        if self.step_s:
            time.sleep(self.step_s)
        digests = self.digests(batch, kv_pools)
        row = torch.zeros((len(digests), *kv_pools.shape[4:]), dtype=kv_pools.dtype)
        row[:, 0, :3] = torch.tensor([[d >> 16, (d >> 8) & 255, d & 255] for d in digests], dtype=kv_pools.dtype)
        row = row.to(kv_pools.device)
        rows = kv_rows(batch.slots, kv_pools.shape[3])
        for layer in range(kv_pools.shape[0]):
            write_kv(kv_pools[layer], rows, row, row)
            if layer_hook is not None:
                layer_hook(layer)
        return self.logits([digests[i] for i in batch.logits_index.tolist()]).to(kv_pools.device)

    def digests(self, batch: ForwardBatch, kv_pools: torch.Tensor) -> list[int]:
        """Each new token's digest: of the token before it (in this batch, or its KV in the
        pool) and of itself."""
        bs = kv_pools.shape[3]
        ids, positions = batch.input_ids.tolist(), batch.positions.tolist()
        # a row's table: its decode sequence's, or its prompt chunk's
        tables: list[list[int]] = [t.tolist() for t in batch.block_tables] if batch.block_tables is not None else []
        starts = {batch.num_decode + start: table.tolist() for start, _, _, table in batch.chunks}
        out: list[int] = []
        for i, (token, pos) in enumerate(zip(ids, positions, strict=True)):
            draft = 0 < i < batch.num_decode and positions[i - 1] == pos - 1 and tables[i - 1] == tables[i]
            if (i < batch.num_decode or i in starts) and not draft:  # (a draft's row follows its sequence's)
                table = tables[i] if i < batch.num_decode else starts[i]
                before = START if pos == 0 else self.stored(kv_pools, table, pos - 1, bs)
            else:   # the previous row is the previous token of the same prompt chunk or draft
                before = out[-1]
            out.append(digest(before, token))
        return out

    @staticmethod
    def stored(kv_pools: torch.Tensor, table: list[int], pos: int, bs: int) -> int:
        """The digest in the KV of position `pos` of the sequence with block table `table`."""
        b0, b1, b2 = (int(x) for x in kv_pools[0, table[pos // bs], 0, pos % bs, 0, :3].tolist())
        return (b0 << 16) | (b1 << 8) | b2

    def logits(self, digests: list[int]) -> torch.Tensor:
        """The digest's word first, then the next SPREAD - 1 words down, every other token FLOOR."""
        out = torch.full((len(digests), self.cfg.vocab_size), FLOOR)
        n = len(self.words)
        for r, d in enumerate(digests):
            picks = self.words[[(d + k) % n for k in range(SPREAD)]]
            out[r, picks] = torch.arange(SPREAD, 0, -1, dtype=torch.float32) * 2.0
        return out
