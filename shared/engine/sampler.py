"""Next-token choice for a batch: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws token n from a generator seeded with H(seed, n), so the same seed
gives the same tokens whether the first token was sampled on a prefill engine and the rest
on a decode engine, or all in one place.
"""

from __future__ import annotations

import logging

import torch
import xxhash

from shared.engine.sequence import Sequence

log = logging.getLogger(__name__)


def step_seed(seed: int, index: int) -> int:
    return xxhash.xxh64_intdigest(f"{seed}:{index}".encode()) & 0x7FFF_FFFF_FFFF_FFFF


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> list[int]:
    """logits (B, vocab) fp32, one row per sequence in `seqs` order. Returns B token ids."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if seq.num_generated < p.min_tokens:  # not allowed to stop yet
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
            if banned:
                logits[row, banned] = float("-inf")
    out = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        if not seq.params.greedy:
            try:
                out[row] = _sample_row(logits[row], seq)
            except RuntimeError as e:  # numerically degenerate parameters: this row, not the batch
                log.warning("%s: sampling failed (%s); took the most likely token", seq.request_id, e)
    return out


def _sample_row(logits: torch.Tensor, seq: Sequence) -> int:
    p = seq.params
    logits = logits / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    gen = torch.Generator(device=logits.device)
    gen.manual_seed(step_seed(seq.seed, seq.num_generated))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=gen).item())
