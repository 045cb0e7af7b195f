"""Torch implementations of the paged-KV kernels: the CPU path and the reference for Triton.

Pool layout (one layer): `pool` is (num_blocks, 2, block_size, kv_heads, head_dim), K at
index 0 and V at index 1 of dim 1, so one block of one layer is one contiguous run of bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_blocks(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy the listed blocks into one contiguous send buffer: (n, 2, bs, kvh, hd)."""
    return pool.index_select(0, block_ids)


def scatter_blocks(pool: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """Write a received buffer (n, 2, bs, kvh, hd) into the listed blocks of the pool."""
    pool.index_copy_(0, block_ids, buffer.view(-1, *pool.shape[1:]))


def kv_rows(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Token slots (T,) = block * block_size + offset as the rows their keys take in a layer's
    pool seen as (num_blocks * 2 * block_size, kvh, hd); their values are block_size further."""
    return (slots // block_size) * (2 * block_size) + slots % block_size


def write_kv(pool: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new keys/values (T, kvh, hd) at `kv_rows` (T,)."""
    n, _, bs, kvh, hd = pool.shape
    flat = pool.view(n * 2 * bs, kvh, hd)
    flat.index_copy_(0, rows, k)
    flat.index_copy_(0, rows + bs, v)


def softcapped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """cap · tanh(scores / cap) (Gemma 2's attention and logits; 0: unchanged)."""
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


def paged_decode_attention(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """One query token per sequence against its paged context (its last `window` tokens, when
    set: the query at position p sees p - window < j <= p); scores soft-capped by `softcap`.

    q (B, H, hd); block_tables (B, max_blocks) int, padded with any valid id;
    context_lens (B,) int. Returns (B, H, hd).
    """
    b, h, hd = q.shape
    kvh = pool.shape[3]
    flat = block_tables.flatten()
    length = block_tables.shape[1] * pool.shape[2]
    # one gather each for K and V straight into (B, L, kvh, hd); blocks are contiguous
    k = pool[:, 0].index_select(0, flat).view(b, length, kvh, hd).permute(0, 2, 3, 1)  # (B, kvh, hd, L)
    v = pool[:, 1].index_select(0, flat).view(b, length, kvh, hd).transpose(1, 2)      # (B, kvh, L, hd)
    # heads that share a KV head become extra query rows: no K/V repeat needed
    qg = q.view(b, kvh, h // kvh, hd)                                                    # (B, kvh, g, hd)
    scores = softcapped(torch.matmul(qg, k) * scale, softcap)                            # (B, kvh, g, L)
    at = torch.arange(length, device=q.device)[None, :]
    pad = at >= context_lens[:, None]                                                    # (B, L)
    if window:
        pad |= at < context_lens[:, None] - window
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    # softmax in fp32 whatever the pool's dtype, as the reference implementations do
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(v.dtype), v).reshape(b, h, hd)


def paged_prefill_attention(q: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor,
                            context_len: int, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """A chunk of n new query tokens of one sequence, whose KV (cached prefix + this chunk)
    is already in the pool. q (n, H, hd); returns (n, H, hd)."""
    n, h, hd = q.shape
    kvh = pool.shape[3]
    kv = pool[block_table]                                    # (nb, 2, bs, kvh, hd)
    k = kv[:, 0].reshape(-1, kvh, hd)[:context_len]
    v = kv[:, 1].reshape(-1, kvh, hd)[:context_len]
    return causal_attention(q, k, v, scale, window, softcap)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """q (n, H, hd) are the last n positions of a context of k, v (L, kvh, hd); each sees the
    positions up to its own (and within `window` of it, when set)."""
    n, h, hd = q.shape
    length, kvh = k.shape[0], k.shape[1]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if length == n and not window and not softcap:
        out = F.scaled_dot_product_attention(qt[None], kt[None], vt[None], is_causal=True,
                                             scale=scale, enable_gqa=kvh != h)
        return out[0].transpose(0, 1)
    rows = torch.arange(length - n, length, device=q.device)[:, None]
    cols = torch.arange(length, device=q.device)[None, :]
    mask = cols <= rows  # (n, L)
    if window:
        mask &= cols > rows - window
    if softcap:  # SDPA cannot soft-cap its scores: the product, cap, mask and softmax in torch
        qg = qt.reshape(kvh, h // kvh, n, hd)                                    # (kvh, g, n, hd)
        scores = softcapped(torch.matmul(qg, kt.transpose(1, 2)[:, None]) * scale, softcap)
        scores = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(scores, vt[:, None]).reshape(h, n, hd).transpose(0, 1)
    out = F.scaled_dot_product_attention(qt[None], kt[None], vt[None], attn_mask=mask,
                                         scale=scale, enable_gqa=kvh != h)
    return out[0].transpose(0, 1)
