"""Weights as a worker computes with them (`PD_WEIGHTS`): `fp32`, every matrix dequantized from
the file, or `native`, the file's own blocks kept as they are and computed with by torch's
CPU weight-only int4 kernel (`Packed`), so a decode step streams ~0.6 bytes a weight instead
of 4.

The kernel's vectorized (AVX2) path takes bfloat16 activations, scales and zeros; with fp32
ones it is ~10x slower than the fp32 matmul at one row (measured here). So a
`Packed` product rounds its input and each group's scale and zero to bfloat16, and its output
comes back in bfloat16: not exact, and bench/engine_quality.py measures what that costs.
The conversions of the blocks themselves are exact (the 4-bit values are the file's):
- Q4_1 (32 weights: q in 0..15, fp16 d and m, w = d·q + m) is the kernel's own form, w =
  (u − 8)·scale + zero, with u = q, scale = d, zero = m + 8d;
- Q8_0 (32 weights: q in −128..127, fp16 d, w = d·q) is two such matrices summed: q = 16·hi
  + lo, lo in 0..15 and hi in −8..7, so w = 16d·hi + d·lo (u = hi + 8, scale 16d, zero 0; and
  u = lo, scale d, zero 8d).
Other formats (F16, F32, Q4_0…) stay fp32 under `native` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FORMATS = ("fp32", "native")
GROUP = 32  # weights per Q4_1 / Q8_0 block: the kernel's group size


@dataclass(frozen=True)
class Packed:
    """A matrix (out, in) as a sum of int4 matrices in the kernel's layout, groups of GROUP
    along the input, each with fp32 (scale, zero) per group and output row."""

    parts: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (packed uint8 (out, in/2), bf16 (in/GROUP, out, 2))
    shape: tuple[int, int]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) @ W.T, returned in x's dtype (fp32)."""
        xb = x.to(torch.bfloat16)
        out = None
        for packed, scales in self.parts:
            y = torch._weight_int4pack_mm_for_cpu(xb, packed, GROUP, scales).to(x.dtype)
            out = y if out is None else out.add_(y)
        assert out is not None
        return out

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes + s.nbytes for p, s in self.parts)

    @classmethod
    def cat(cls, mats: list[Packed]) -> Packed:
        """Matrices stacked along the output (q, k and v as one projection)."""
        if len({len(m.parts) for m in mats}) != 1:
            raise ValueError("can only stack matrices of the same format")
        parts = tuple((torch.cat([m.parts[i][0] for m in mats]), torch.cat([m.parts[i][1] for m in mats], dim=1))
                      for i in range(len(mats[0].parts)))
        return cls(parts, (sum(m.shape[0] for m in mats), mats[0].shape[1]))


def _part(u: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """u (out, in) in 0..15 and per-group scale, zero (out, in/GROUP): the kernel's operands."""
    packed = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(u.astype(np.int32)), 1)
    scales = torch.from_numpy(np.stack([scale.T, zero.T], axis=-1).astype(np.float32))
    return packed, scales.to(torch.bfloat16).contiguous()


def _blocks(raw: np.ndarray, rows: int, size: int) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1, size)


def q4_1(raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_1 tensor's (rows, blocks·20 bytes) as q (rows, in) in 0..15, d and m (rows, in/32)."""
    b = _blocks(raw, rows, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:]  # element i in the low nibble of byte i, element 16 + i in its high nibble
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return q.reshape(rows, -1), d, m


def q8_0(raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's (rows, blocks·34 bytes) as q (rows, in) in −128..127, d (rows, in/32)."""
    b = _blocks(raw, rows, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return b[..., 2:].copy().view(np.int8).reshape(rows, -1), d


def pack_q4_1(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> Packed:
    return Packed((_part(q, d, m + 8 * d),), q.shape)


def pack_q8_0(q: np.ndarray, d: np.ndarray) -> Packed:
    q16 = q.astype(np.int16)
    lo, hi = q16 & 0x0F, q16 >> 4  # q = 16·hi + lo (an arithmetic shift: hi in −8..7)
    return Packed((_part(hi + 8, 16 * d, np.zeros_like(d)), _part(lo, d, 8 * d)), q.shape)


def pack(raw: np.ndarray, kind: str, reorder=lambda rows: rows) -> Packed | None:
    """A GGUF tensor's raw blocks (rows, bytes) as `Packed`, its rows put in order by `reorder`
    (a permutation of the first axis), or None for a format kept in fp32."""
    if kind == "Q4_1":
        return pack_q4_1(*map(reorder, q4_1(raw, raw.shape[0])))
    if kind == "Q8_0":
        return pack_q8_0(*map(reorder, q8_0(raw, raw.shape[0])))
    return None
