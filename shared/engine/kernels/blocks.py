"""The C kernel for products with a GGUF file's own Q4_1 / Q8_0 blocks (blocks.c), built on
first use (cc.py) and called through ctypes."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from shared.engine.kernels import cc

SOURCE = Path(__file__).with_name("blocks.c")
KINDS = {"Q4_1": 0, "Q8_0": 1}


@cache
def library(path: Path | None = None) -> ctypes.CDLL:
    """The kernel for this machine's CPU, or the build at `path` (tests)."""
    lib = ctypes.CDLL(str(path or cc.build(SOURCE)))
    lib.blocks_matmul.restype = ctypes.c_int
    lib.blocks_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                                  ctypes.c_int, ctypes.c_int]
    return lib


def _ptr(t: torch.Tensor | None, shape: tuple[int, ...]) -> int | None:
    if t is None:
        return None
    if t.dtype is not torch.float32 or not t.is_contiguous() or t.shape != shape:
        raise ValueError(f"expected a contiguous float32 tensor {shape}, got {t.dtype} {tuple(t.shape)}")
    return t.data_ptr()


def matmul(kind: str, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
           norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """residual + f(x) @ W.T for W (N, K) as the file's blocks: w (N, K/32 · bytes a block)
    uint8, contiguous; f RMS-normalizes with `norm` (weight (K,), eps), or with `swiglu` takes
    x (M, 2K) as (gate, up) and computes silu(gate)·up. Returns (M, N) fp32. `lib`: another
    build of the kernel (tests)."""
    if x.dtype is not torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    m, k = x.shape[0], x.shape[1] // 2 if swiglu else x.shape[1]
    n = w.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    weight, eps = norm if norm is not None else (None, 0.0)
    rc = (lib or library()).blocks_matmul(KINDS[kind], x.data_ptr(), m, k, w.data_ptr(), n, y.data_ptr(),
                                 _ptr(residual, (m, n)), _ptr(weight, (k,)), eps, int(swiglu),
                                 torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"blocks_matmul failed for x {tuple(x.shape)} (input width not a multiple of 32, "
                           "or out of memory)")
    return y
