"""Weights as a worker computes with them (`PD_WEIGHTS`): `fp32`, every matrix dequantized from
the file, or `native`, the file's own blocks kept byte for byte (`Packed`: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and computed with by a small C kernel (kernels/blocks.c), so a
decode step streams 0.56–1.06 bytes a weight instead of 4.

Nothing is re-quantized. The kernel quantizes each row of activations to 8 bits per group of
32 (as llama.cpp does) and multiplies with integer dot products: not exact, and
bench/engine/quality.py measures what that costs. Other formats (F16, F32, Q2_K, Q3_K, the IQ
formats…) stay fp32 under `native` too. `auto`, the default setting, is `native` for a GGUF on
CPU (`choose`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.shared.engine.kernels import blocks

FORMATS = ("fp32", "native")
SETTINGS = ("auto", *FORMATS)  # auto: `choose`


def choose(setting: str, gguf: bool, device: str, dtype: torch.dtype) -> str:
    """The format a `setting` computes with: `auto` is native for a GGUF file on CPU in float32
    (the file's own numbers, as llama.cpp computes them), fp32 for anything else."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown weights format {setting!r}: expected one of {', '.join(SETTINGS)}")
    if setting != "auto":
        return setting
    return "native" if gguf and device == "cpu" and dtype == torch.float32 else "fp32"


@dataclass(frozen=True)
class Packed:
    """A matrix (out, in) as the file's blocks: `parts`, (format, raw rows (rows, bytes) uint8)
    stacked along the output, each part in its own format (Q4_K_M files mix them)."""

    parts: tuple[tuple[str, torch.Tensor], ...]
    shape: tuple[int, int]
    descriptor: torch.Tensor = field(init=False, repr=False, compare=False)  # blocks.descriptor

    def __post_init__(self) -> None:
        object.__setattr__(self, "descriptor", blocks.descriptor(list(self.parts)))

    def matmul(self, x: torch.Tensor, residual: torch.Tensor | None = None,
               norm: tuple[torch.Tensor, float] | None = None, gate: str = "", plus_one: bool = False
               ) -> torch.Tensor:
        """residual + f(x) @ W.T in fp32, f the RMSNorm or gate before it (kernels/blocks.py)."""
        return blocks.matmul(self.descriptor, self.shape[0], x, residual, norm, gate, plus_one)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.parts)

    @classmethod
    def cat(cls, mats: list[Packed]) -> Packed:
        """Matrices stacked along the output (q, k and v as one projection), neighbours of one
        format joined into one part."""
        parts: list[tuple[str, torch.Tensor]] = []
        for kind, raw in (p for m in mats for p in m.parts):
            if parts and parts[-1][0] == kind:
                parts[-1] = (kind, torch.cat([parts[-1][1], raw]))
            else:
                parts.append((kind, raw))
        if len(parts) > blocks.PARTS:
            raise ValueError(f"can only stack matrices of at most {blocks.PARTS} formats")
        return cls(tuple(parts), (sum(m.shape[0] for m in mats), mats[0].shape[1]))


def pack(raw: np.ndarray, kind: str, reorder: Callable[[np.ndarray], np.ndarray] = lambda rows: rows) -> Packed | None:
    """A GGUF tensor's raw blocks (rows, bytes) as `Packed`, its rows put in order by `reorder`
    (a permutation of the first axis), or None for a format kept in fp32."""
    if kind not in blocks.BLOCKS:
        return None
    per, size = blocks.BLOCKS[kind]
    rows = raw.shape[0]
    # a copy, not the file's mapping
    b = np.array(reorder(np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)), order="C")
    return Packed(((kind, torch.from_numpy(b)),), (rows, b.shape[1] // size * per))
