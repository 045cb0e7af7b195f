"""Split-KV paged decode attention in Triton (flash-decoding), grouped by KV head.

Same contract as `torch_ref.paged_decode_attention` (scale, sliding window, soft-capping, context
lengths, block tables; pool layout (num_blocks, 2, block_size, kv_heads, head_dim) per layer).
Two passes:

1. program (b, g, s): sequence b's KV head g over split s of its attended positions, for all
   H / KVH query heads of the group at once (one read of each K/V row serves the whole group:
   the scores are a (heads, tokens) product); writes the split's running max, sum and
   unnormalized output. With one split it writes the normalized output and pass 2 is skipped.
2. program (b, h): the splits of one query head merged (rescaled to their common max).

Each sequence's attended positions [first, ctx) are cut into `splits` near-equal ranges of its
own length, so the programs of one sequence do equal work. The number of splits comes from the
launch's shape alone (`num_splits`: no device-to-host read of the context lengths), enough
programs for one per streaming multiprocessor.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from pdserve.shared.engine.kernels.triton_kernels import on_device

MIN_SPLIT_TOKENS = 16  # a split covers at least this many positions of the longest context
TILE = 32  # positions scored per step of a program (gathered through the block table one by one)


def num_splits(batch: int, kv_heads: int, context: int, sm_count: int) -> int:
    """Splits of each sequence's context: enough that batch · kv_heads · splits programs give
    every SM one, no more than `context` / MIN_SPLIT_TOKENS (`context`: the most positions a
    sequence of the launch attends to)."""
    want = -(-sm_count // max(1, batch * kv_heads))
    return max(1, min(want, context // MIN_SPLIT_TOKENS))


@cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter runs programs one
    at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


# Triton reads a kernel's parameter annotations (tl.constexpr: compiled in): the others stay bare
@triton.jit
def _attend(q, pool_ptr, table_ptr, g, lo, hi, scale, softcap, KVH: tl.constexpr,  # type: ignore[no-untyped-def]
            HD: tl.constexpr, HD_P: tl.constexpr, BS: tl.constexpr, G_P: tl.constexpr, TILE_N: tl.constexpr,
            F32_DOT: tl.constexpr):
    """Online softmax of q (G_P, HD_P) over positions [lo, hi) of one sequence (its block table at
    table_ptr), KV head g: running max and sum (G_P,) and unnormalized output (G_P, HD_P)."""
    d = tl.arange(0, HD_P)
    n = tl.arange(0, TILE_N)
    m_i = tl.full([G_P], -float("inf"), tl.float32)
    l_i = tl.zeros([G_P], dtype=tl.float32)
    acc = tl.zeros([G_P, HD_P], dtype=tl.float32)
    for start in range(lo, hi, TILE_N):
        pos = start + n                                                    # (TILE_N,) positions
        valid = pos < hi
        block = tl.load(table_ptr + pos // BS, mask=valid, other=0).to(tl.int64)
        row = ((block * 2) * BS + pos % BS) * KVH + g                      # K rows; V is BS·KVH rows on
        kv_off = row[:, None] * HD + d[None, :]
        kv_mask = valid[:, None] & (d < HD)[None, :]
        k = tl.load(pool_ptr + kv_off, mask=kv_mask, other=0.0)           # (TILE_N, HD_P)
        v = tl.load(pool_ptr + kv_off + BS * KVH * HD, mask=kv_mask, other=0.0)
        if F32_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
        # (ieee: an fp32 pool's products exact, not tf32; bf16 products are exact either way)
        sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (G_P, TILE_N)
        if softcap > 0:  # cap * tanh(s / cap), tanh as 2 sigmoid(2x) - 1
            sc = softcap * (2 * tl.sigmoid(2 * sc / softcap) - 1)
        sc = tl.where(valid[None, :], sc, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _split_kernel(q_ptr, pool_ptr, tables_ptr, lens_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,  # type: ignore[no-untyped-def]
                  scale, window, softcap, max_blocks, splits, H: tl.constexpr, KVH: tl.constexpr,
                  HD: tl.constexpr, HD_P: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
                  G_P: tl.constexpr, TILE_N: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    r = tl.arange(0, G_P)                     # (G_P,) query heads of the group, padded
    d = tl.arange(0, HD_P)
    heads = g * G + r
    q_off = (b * H + heads)[:, None] * HD + d[None, :]
    qd_mask = (r < G)[:, None] & (d < HD)[None, :]
    q = tl.load(q_ptr + q_off, mask=qd_mask, other=0.0)                   # (G_P, HD_P)
    if F32_DOT:  # (the interpreter's dot multiplies bfloat16's raw bits: it takes fp32)
        q = q.to(tl.float32)
    else:
        q = q.to(pool_ptr.dtype.element_ty)
    ctx = tl.load(lens_ptr + b)
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # the window's first position
    span = ctx - first
    lo = first + (span * s) // splits
    hi = first + (span * (s + 1)) // splits
    m_i, l_i, acc = _attend(q, pool_ptr, tables_ptr + b * max_blocks, g, lo, hi, scale, softcap, KVH, HD, HD_P,
                            BS, G_P, TILE_N, F32_DOT)
    if SPLIT:  # (b, head, s): partial results for the merge
        part = (b * H + heads) * splits + s
        tl.store(m_ptr + part, m_i, mask=r < G)
        tl.store(l_ptr + part, l_i, mask=r < G)
        tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=qd_mask)
    else:
        tl.store(out_ptr + q_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=qd_mask)


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, splits, HD: tl.constexpr,  # type: ignore[no-untyped-def]
                  HD_P: tl.constexpr, S_P: tl.constexpr):
    # program (b, h): row b·H + h of the partials; an empty split (m = -inf, l = 0) weighs 0
    row = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    sp = tl.arange(0, S_P)
    d = tl.arange(0, HD_P)
    d_mask = d < HD
    m = tl.load(m_ptr + row * splits + sp, mask=sp < splits, other=-float("inf"))
    m_max = tl.max(m, axis=0)
    w = tl.exp(m - m_max)
    total = tl.sum(w * tl.load(l_ptr + row * splits + sp, mask=sp < splits, other=0.0), axis=0)
    acc = tl.zeros([HD_P], dtype=tl.float32)
    for s in range(0, splits):
        ws = tl.exp(tl.load(m_ptr + row * splits + s) - m_max)
        acc += ws * tl.load(acc_ptr + (row * splits + s) * HD + d, mask=d_mask, other=0.0)
    tl.store(out_ptr + row * HD + d, (acc / total).to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int = 0,
                           softcap: float = 0.0, splits: int | None = None) -> torch.Tensor:
    """q (B, H, hd) against each sequence's paged context -> (B, H, hd). `splits`: the number of
    splits of each context (default `num_splits` of the launch: its longest context is the block
    tables' width, or the window)."""
    b, h, hd = q.shape
    _, _, bs, kvh, _ = pool.shape
    if bs & (bs - 1):
        raise ValueError(f"KV block size {bs}: the Triton decode kernel needs a power of two")
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32)
    longest = min(tables.shape[1] * bs, window) if window > 0 else tables.shape[1] * bs
    splits = splits or num_splits(b, kvh, longest, sm_count(q.device))
    out = torch.empty_like(q)
    hd_p = max(16, triton.next_power_of_2(hd))
    if splits > 1:  # (B, H, splits) fp32 partials
        m = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
        l_sum, acc = torch.empty_like(m), torch.empty((b, h, splits, hd), dtype=torch.float32, device=q.device)
    else:
        m = l_sum = acc = out  # (not read: the one-split kernel writes `out`)
    with on_device(q):
        _split_kernel[(b, kvh, splits)](q, pool, tables, lens, out, m, l_sum, acc, scale, window, float(softcap),
                                        tables.shape[1], splits, H=h, KVH=kvh, HD=hd, HD_P=hd_p, BS=bs,
                                        G=h // kvh, G_P=max(16, triton.next_power_of_2(h // kvh)),
                                        TILE_N=TILE, SPLIT=splits > 1, F32_DOT=not q.is_cuda)
        if splits > 1:
            _merge_kernel[(b, h)](m, l_sum, acc, out, splits, HD=hd, HD_P=hd_p,
                                  S_P=triton.next_power_of_2(splits))
    return out
