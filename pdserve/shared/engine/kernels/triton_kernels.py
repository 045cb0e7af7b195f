"""Triton kernels for the GPU path (same contracts as torch_ref.py, which is their reference).

On CUDA they are compiled; on CPU they run only under TRITON_INTERPRET=1 (tests, small
inputs). Pool layout (one layer): (num_blocks, 2, block_size, kv_heads, head_dim), contiguous.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import triton
import triton.language as tl

_COPY_CHUNK = 1024


# Triton reads a kernel's parameter annotations (tl.constexpr: compiled in): the others stay bare
@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, ids_ptr, block_elems, GATHER: tl.constexpr,  # type: ignore[no-untyped-def]
                        CHUNK: tl.constexpr):
    # program (i, c): chunk c of the i-th listed block
    i = tl.program_id(0)
    c = tl.program_id(1)
    block = tl.load(ids_ptr + i).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_elems
    if GATHER:
        src = src_ptr + block * block_elems + offs
        dst = dst_ptr + i.to(tl.int64) * block_elems + offs
    else:
        src = src_ptr + i.to(tl.int64) * block_elems + offs
        dst = dst_ptr + block * block_elems + offs
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, gather: bool,
                 block_elems: int) -> None:
    n = block_ids.numel()
    if n == 0:
        return
    grid = (n, triton.cdiv(block_elems, _COPY_CHUNK))
    with on_device(src):
        _copy_blocks_kernel[grid](src, dst, block_ids, block_elems, GATHER=gather, CHUNK=_COPY_CHUNK)


def on_device(t: torch.Tensor) -> AbstractContextManager[object]:
    """A Triton launch goes to the current CUDA device of the calling thread: make it `t`'s (cuda:N
    from a thread where device 0 is current, as the engine's is)."""
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


def gather_blocks(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    out = torch.empty((block_ids.numel(), *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    _launch_copy(pool, out, block_ids, True, pool[0].numel())
    return out


def scatter_blocks(pool: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    _launch_copy(buffer.contiguous(), pool, block_ids, False, pool[0].numel())


@triton.jit
def _paged_decode_kernel(q_ptr, pool_ptr, tables_ptr, lens_ptr, out_ptr, scale, window, softcap,  # type: ignore[no-untyped-def]
                         max_blocks, H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr,
                         HD_P: tl.constexpr, BS: tl.constexpr):
    # program (b, h): query head h of sequence b, online softmax over its context blocks (the
    # last `window` positions when window > 0: the blocks before them are not read)
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // (H // KVH)
    d = tl.arange(0, HD_P)
    d_mask = d < HD
    t = tl.arange(0, BS)
    q = tl.load(q_ptr + (b * H + h) * HD + d, mask=d_mask, other=0.0).to(tl.float32)
    ctx = tl.load(lens_ptr + b)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([HD_P], dtype=tl.float32)
    first = 0
    if window > 0:
        first = tl.maximum(ctx - window, 0)
    for i in range(first // BS, tl.cdiv(ctx, BS)):
        block = tl.load(tables_ptr + b * max_blocks + i).to(tl.int64)
        row = ((block * 2) * BS + t) * KVH + kv_head                       # (BS,) K rows
        kv_off = row[:, None] * HD + d[None, :]
        valid = ((i * BS + t) < ctx) & ((i * BS + t) >= first)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(pool_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(pool_ptr + kv_off + BS * KVH * HD, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        if softcap > 0:  # cap * tanh(s / cap), tanh as 2 sigmoid(2x) - 1
            s = softcap * (2 * tl.sigmoid(2 * s / softcap) - 1)
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + (b * H + h) * HD + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    b, h, hd = q.shape
    _, _, bs, kvh, _ = pool.shape
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if bs & (bs - 1):
        raise ValueError(f"KV block size {bs}: the Triton decode kernel needs a power of two (tl.arange)")
    with on_device(q):
        _paged_decode_kernel[(b, h)](q, pool, tables, context_lens.to(torch.int32), out, scale, window,
                                     float(softcap), tables.shape[1], H=h, KVH=kvh, HD=hd,
                                     HD_P=triton.next_power_of_2(hd), BS=bs)
    return out
