"""Seeded sampling of many rows at once on the device: each row's temperature, min-p, top-k and top-p as
sampler.py applies them, then a draw whose randomness is a pure function of the row's key (sampler.step_seed of
the request's seed and the token's index) and the token id: no generator state, no host round trip, the same
token for the same logits and key in any batch, on any device.

The draw is Gumbel-max: token = argmax(logits / T + G), G = -log(-log u) with u uniform in (0, 1), which picks
token i with probability softmax(logits / T)_i. u for (key, token j) comes from a counter-based hash (murmur3's
32-bit finalizer, twice: once over j mixed with the key's low half, once with its high half), computed in int64
tensors in 16-bit steps so that no product overflows; its top 24 bits make u exactly in float32.

A CPU engine keeps sampler.py's per-row torch.Generator draws (its tokens for a seed are those it always gave);
a CUDA engine draws here, through the batched path (device_sampler.py) and the per-row one alike, so a request's
tokens for a seed are the same on every CUDA engine whichever path a step takes.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

M32 = 0xFFFF_FFFF
ROWS_AT_ONCE = 32  # rows hashed together: the hash's (rows, vocab) int64 temporaries stay ~40 MB at 150k tokens


@dataclass
class Rows:
    """Per-row settings (n,) on the logits' device, and which filters any row uses (known on the host, so that
    no filter is computed for nobody and nothing is read back to decide)."""

    temperature: torch.Tensor  # float32, > 0
    top_k: torch.Tensor        # int64, 0: off
    top_p: torch.Tensor        # float32, 1: off
    min_p: torch.Tensor        # float32, 0: off
    keys: torch.Tensor         # int64 in [0, 2**63): sampler.step_seed(seed, token index)
    any_top_k: bool = False
    any_top_p: bool = False
    any_min_p: bool = False

    @classmethod
    def of(cls, temperature: Seq[float], top_k: Seq[int], top_p: Seq[float], min_p: Seq[float], keys: Seq[int],
           device: torch.device) -> Rows:
        """Rows from host values (the per-row path: a copy to the device each)."""
        def f32(values: Seq[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def i64(values: Seq[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(f32(temperature), i64(top_k), f32(top_p), f32(min_p), i64(keys), any(k > 0 for k in top_k),
                   any(p < 1 for p in top_p), any(p > 0 for p in min_p))

    def part(self, start: int, end: int) -> Rows:
        return Rows(self.temperature[start:end], self.top_k[start:end], self.top_p[start:end],
                    self.min_p[start:end], self.keys[start:end], self.any_top_k, self.any_top_p, self.any_min_p)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x · c mod 2**32 for 0 <= x < 2**32 (int64), in two 16-bit halves of c: no product reaches 2**63."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix32 on values below 2**32."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EB_CA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2_AE35)
    return h ^ (h >> 16)


def uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(n, vocab) float32 in (0, 1): u(key_i, j), a pure function of the key and the token id."""
    j = torch.arange(vocab, dtype=torch.long, device=keys.device)[None, :]
    low, high = (keys & M32)[:, None], ((keys >> 32) & M32)[:, None]
    h = _mix32(_mix32(_mul32(j, 0x9E37_79B1) ^ low) ^ high)
    return ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24


def filtered(logits: torch.Tensor, rows: Rows) -> torch.Tensor:
    """logits (n, vocab) fp32 / temperature, with the tokens min-p, top-k and top-p drop at -inf (sampler.py's
    rules: top-k keeps ties with the k-th value; top-p keeps the smallest set reaching it, after top-k)."""
    out = logits / rows.temperature[:, None]
    if rows.any_min_p:
        probs = out.softmax(-1)
        out = out.masked_fill(probs < rows.min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    if rows.any_top_k or rows.any_top_p:
        ordered, order = out.sort(-1, descending=True)
        vocab = out.shape[-1]
        k = torch.where(rows.top_k > 0, rows.top_k, vocab).clamp(1, vocab)
        kth = ordered.gather(1, (k - 1)[:, None])
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        out = out.masked_fill(out < kth, float("-inf"))
        if rows.any_top_p:
            probs = ordered.softmax(-1)
            drop = (probs.cumsum(-1) - probs >= rows.top_p[:, None]) & (rows.top_p < 1.0)[:, None]
            out = out.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return out


def sample(logits: torch.Tensor, rows: Rows) -> torch.Tensor:
    """(n,) int64 on the logits' device: each row's token drawn from its filtered distribution with its key.
    Issues no host-device synchronization."""
    picked = []
    for start in range(0, logits.shape[0], ROWS_AT_ONCE):
        part = rows.part(start, start + ROWS_AT_ONCE)
        scores = filtered(logits[start:start + ROWS_AT_ONCE], part)
        picked.append((scores - torch.log(-torch.log(uniform(part.keys, scores.shape[-1])))).argmax(-1))
    return picked[0] if len(picked) == 1 else torch.cat(picked)
