"""Decode attention over the paged pool in C on CPU (attention.c, built by cc.py):
`paged_decode_attention` is torch_ref's, one call a layer instead of ~10 small ops; and
`decode_attention` is the decode step's whole attention after the qkv product (RoPE, the KV
write and attention) in one call. fp32 only (`usable` says; the model takes torch's path
otherwise)."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from pdserve.shared.engine.kernels import cc, torch_ref

SOURCE = Path(__file__).with_name("attention.c")


@cache
def library(path: Path | None = None) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path or cc.build(SOURCE)))
    lib.paged_decode_attention.restype = ctypes.c_int
    lib.paged_decode_attention.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [
        ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [
        ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


MAX_HEAD_DIM = 256  # attention.c's accumulator


def usable(pool: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether the C kernels take this pool (head_dim within MAX_HEAD_DIM) and these tensors:
    fp32, contiguous, on CPU."""
    return pool.shape[4] <= MAX_HEAD_DIM and all(
        t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in (pool, *tensors))


def _check(rc: int, name: str) -> None:
    if rc == -2:
        raise ValueError(f"{name}: head_dim over {MAX_HEAD_DIM}")
    if rc != 0:
        raise MemoryError(f"{name}: out of memory for its scores")


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
                     rows: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, heads: int,
                     scale: float) -> torch.Tensor:
    """qkv (B, (heads + 2·kvh)·hd) from the qkv product (rotated in place); cos, sin (B, hd) at
    each token's position, sin with its first half negated (attention.Rotary's tables); rows (B,)
    `torch_ref.kv_rows` of the new tokens. Writes their K/V into pool; returns (B, heads·hd)."""
    b, hd, kvh = qkv.shape[0], pool.shape[4], pool.shape[3]
    out = torch.empty((b, heads * hd), dtype=torch.float32)
    ints = [t.to(torch.int64).contiguous() for t in (rows, block_tables, context_lens)]
    rc = library().decode_attention(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), pool.data_ptr(), *(t.data_ptr() for t in ints), b, heads, kvh,
        hd, pool.shape[2], ints[1].shape[1], scale, out.data_ptr(), torch.get_num_threads())
    _check(rc, "decode_attention")
    return out


def paged_decode_attention(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """q (B, H, hd); pool (num_blocks, 2, bs, kvh, hd); block_tables (B, width); context_lens
    (B,); the query at position p sees p - window < j <= p when `window` is set, its scores
    soft-capped by `softcap` when set. Returns (B, H, hd). `lib`: another build of the kernel
    (tests)."""
    if q.dtype != torch.float32 or not usable(pool):
        return torch_ref.paged_decode_attention(q, pool, block_tables, context_lens, scale, window, softcap)
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    b, h, hd = q.shape
    rc = (lib or library()).paged_decode_attention(
        q.data_ptr(), pool.data_ptr(), tables.data_ptr(), lens.data_ptr(), b, h, pool.shape[3], hd, pool.shape[2],
        tables.shape[1], scale, window, softcap, out.data_ptr(), torch.get_num_threads())
    _check(rc, "paged_decode_attention")
    return out
