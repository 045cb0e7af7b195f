"""Weights as a worker computes with them (`PD_WEIGHTS`): `fp32`, every matrix dequantized from
the file, or `native`, the file's own Q4_1 / Q8_0 blocks kept byte for byte (`Packed`) and
computed with by a small C kernel (kernels/blocks.c), so a decode step streams 0.625 bytes a
weight (1.06 for Q8_0) instead of 4.

Nothing is re-quantized. The kernel quantizes each row of activations to 8 bits per block of
32 (as llama.cpp does) and multiplies with integer dot products: not exact, and
bench/engine/quality.py measures what that costs. Other formats (F16, F32, Q4_0…) stay fp32
under `native` too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shared.engine.kernels import blocks

FORMATS = ("fp32", "native")
GROUP = 32  # weights per Q4_1 / Q8_0 block
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # fp16 scale (and fp16 minimum for Q4_1), then the values


@dataclass(frozen=True)
class Packed:
    """A matrix (out, in) as the file's blocks: `raw` (out, in/32 · bytes a block) uint8."""

    kind: str  # "Q4_1" or "Q8_0"
    raw: torch.Tensor
    shape: tuple[int, int]

    def matmul(self, x: torch.Tensor, residual: torch.Tensor | None = None,
               norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False) -> torch.Tensor:
        """residual + f(x) @ W.T in fp32, f the RMSNorm or SwiGLU before it (kernels/blocks.py)."""
        return blocks.matmul(self.kind, x, self.raw, residual, norm, swiglu)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    @classmethod
    def cat(cls, mats: list[Packed]) -> Packed:
        """Matrices stacked along the output (q, k and v as one projection)."""
        if len({m.kind for m in mats}) != 1:
            raise ValueError("can only stack matrices of the same format")
        return cls(mats[0].kind, torch.cat([m.raw for m in mats]), (sum(m.shape[0] for m in mats), mats[0].shape[1]))


def pack(raw: np.ndarray, kind: str, reorder: Callable[[np.ndarray], np.ndarray] = lambda rows: rows) -> Packed | None:
    """A GGUF tensor's raw blocks (rows, bytes) as `Packed`, its rows put in order by `reorder`
    (a permutation of the first axis), or None for a format kept in fp32."""
    if kind not in BLOCK_BYTES:
        return None
    rows = raw.shape[0]
    # a copy, not the file's mapping
    b = np.array(reorder(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)), order="C")
    return Packed(kind, torch.from_numpy(b), (rows, b.shape[1] // BLOCK_BYTES[kind] * GROUP))
