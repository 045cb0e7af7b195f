"""Decode attention over the paged pool in C on CPU (attention.c, built by cc.py): torch_ref's
`paged_decode_attention`, one call a layer instead of ~10 small ops. Other dtypes than fp32
take torch_ref's path."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from shared.engine.kernels import cc, torch_ref

SOURCE = Path(__file__).with_name("attention.c")


@cache
def library(path: Path | None = None) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path or cc.build(SOURCE)))
    lib.paged_decode_attention.restype = ctypes.c_int
    lib.paged_decode_attention.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [
        ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


def paged_decode_attention(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """q (B, H, hd); pool (num_blocks, 2, bs, kvh, hd); block_tables (B, width); context_lens
    (B,). Returns (B, H, hd). `lib`: another build of the kernel (tests)."""
    if q.dtype != torch.float32 or pool.dtype != torch.float32 or not pool.is_contiguous():
        return torch_ref.paged_decode_attention(q, pool, block_tables, context_lens, scale)
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    b, h, hd = q.shape
    rc = (lib or library()).paged_decode_attention(
        q.data_ptr(), pool.data_ptr(), tables.data_ptr(), lens.data_ptr(), b, h, pool.shape[3], hd, pool.shape[2],
        tables.shape[1], scale, out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged_decode_attention: out of memory for its scores")
    return out
