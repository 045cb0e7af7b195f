"""The C kernel for products with a GGUF file's own blocks (blocks.c, formats.c, steps.c), built
on first use (cc.py) and called through ctypes."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from pdserve.shared.engine.kernels import cc

SOURCE = Path(__file__).with_name("blocks.c")
INCLUDES = (Path(__file__).with_name("formats.c"), Path(__file__).with_name("steps.c"))
# formats.c's enum; each format's (weights, bytes) a block
KINDS = {"Q4_1": 0, "Q8_0": 1, "Q4_0": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}
BLOCKS = {"Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
PARTS = 3  # row ranges of different formats one matrix may stack (blocks.c's struct matrix)
GATES = {"": 0, "silu": 1, "gelu_tanh": 2}  # blocks.c's enum: act(gate)·up before the product


@cache
def library(path: Path | None = None) -> ctypes.CDLL:
    """The kernel for this machine's CPU, or the build at `path` (tests)."""
    lib = ctypes.CDLL(str(path or cc.build(SOURCE, includes=INCLUDES)))
    lib.blocks_matmul.restype = ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.blocks_matmul.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int]
    return lib


def descriptor(parts: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """blocks.c's `struct matrix` for parts (format, raw rows) stacked along the output: int64
    (parts, kind × 3, rows × 3, address × 3). The tensors must outlive it."""
    if not 1 <= len(parts) <= PARTS:
        raise ValueError(f"a matrix stacks 1 to {PARTS} parts, not {len(parts)}")
    pad = [0] * (PARTS - len(parts))
    return torch.tensor([len(parts), *(KINDS[k] for k, _ in parts), *pad, *(t.shape[0] for _, t in parts), *pad,
                         *(t.data_ptr() for _, t in parts), *pad], dtype=torch.int64)


def _ptr(t: torch.Tensor | None, shape: tuple[int, ...]) -> int | None:
    if t is None:
        return None
    if t.dtype is not torch.float32 or not t.is_contiguous() or t.shape != shape:
        raise ValueError(f"expected a contiguous float32 tensor {shape}, got {t.dtype} {tuple(t.shape)}")
    return t.data_ptr()


def matmul(matrix: torch.Tensor, n: int, x: torch.Tensor, residual: torch.Tensor | None = None,
           norm: tuple[torch.Tensor, float] | None = None, gate: str = "", plus_one: bool = False,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """residual + f(x) @ W.T for W (n, K) as the file's blocks, `matrix` its `descriptor`; f
    RMS-normalizes with `norm` (weight (K,), eps; scaled by 1 + weight with `plus_one`), or with
    a `gate` (GATES) takes x (M, 2K) as (gate, up) and computes act(gate)·up. Returns (M, n)
    fp32. `lib`: another build of the kernel (tests)."""
    if x.dtype is not torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    m, k = x.shape[0], x.shape[1] // 2 if gate else x.shape[1]
    y = torch.empty((m, n), dtype=torch.float32)
    weight, eps = norm if norm is not None else (None, 0.0)
    rc = (lib or library()).blocks_matmul(matrix.data_ptr(), x.data_ptr(), m, k, y.data_ptr(), _ptr(residual, (m, n)),
                                          _ptr(weight, (k,)), eps, int(plus_one), GATES[gate],
                                          torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"blocks_matmul failed for x {tuple(x.shape)} (input width not whole blocks of the "
                           "weights' format, or out of memory)")
    return y
