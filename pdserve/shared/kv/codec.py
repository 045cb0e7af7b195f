"""How a KV block travels: "native" (the pool's bytes as they are) or "int8" (optional,
PD_KV_TRANSFER_ENCODING=int8: symmetric int8 with fp32 scales per block — keys per channel
(one scale per head and dimension over the block's tokens: RoPE'd keys have outlier
channels), values per token (one per token and head) — 0.29x the bytes of fp32, 0.58x of
bf16; its quality cost is measured by `make bench-transfer`).

An encoded block is one row of bytes; checksums cover the encoded row, so a corrupt int8
block is caught exactly like a native one.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

Encoding = Literal["native", "int8"]


def block_nbytes(encoding: Encoding, block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one encoded block; block_shape is (2, block_size, kv_heads, head_dim)."""
    kv, bs, heads, dim = block_shape
    if encoding == "native":
        return kv * bs * heads * dim * torch.empty((), dtype=dtype).element_size()
    if encoding == "int8":
        return kv * bs * heads * dim + (heads * dim + bs * heads) * 4
    raise ValueError(f"unknown KV encoding {encoding!r} (native, int8)")


def encode(encoding: Encoding, blocks: torch.Tensor) -> np.ndarray:
    """(n, 2, bs, kvh, hd) blocks → (n, encoded block bytes) uint8 on the host."""
    n = blocks.shape[0]
    if encoding == "native":
        raw = blocks.reshape(n, -1).view(torch.uint8)
        return raw.numpy() if raw.device.type == "cpu" else raw.cpu().numpy()
    x = blocks.float()
    k_scale = (x[:, 0].abs().amax(dim=1) / 127).clamp_min(1e-12)        # (n, kvh, hd): per channel
    v_scale = (x[:, 1].abs().amax(dim=3) / 127).clamp_min(1e-12)        # (n, bs, kvh): per token
    q = torch.stack([x[:, 0] / k_scale[:, None], x[:, 1] / v_scale[..., None]], dim=1)
    codes = torch.round(q).clamp_(-127, 127).to(torch.int8).reshape(n, -1).cpu().numpy().view(np.uint8)
    scales = torch.cat([k_scale.reshape(n, -1), v_scale.reshape(n, -1)], dim=1).cpu().numpy()
    return np.concatenate([codes, scales.view(np.uint8)], axis=1)


def decode(encoding: Encoding, rows: np.ndarray, block_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """(n, encoded block bytes) uint8 → (n, 2, bs, kvh, hd) blocks of `dtype` (CPU)."""
    n = rows.shape[0]
    if encoding == "native":
        return torch.from_numpy(rows).view(dtype).reshape(n, *block_shape)
    kv, bs, heads, dim = block_shape
    values = kv * bs * heads * dim
    q = torch.from_numpy(np.ascontiguousarray(rows[:, :values]).view(np.int8)).reshape(n, *block_shape).float()
    scales = torch.from_numpy(np.ascontiguousarray(rows[:, values:]).view(np.float32))
    k_scale = scales[:, :heads * dim].reshape(n, 1, heads, dim)
    v_scale = scales[:, heads * dim:].reshape(n, bs, heads, 1)
    return torch.stack([q[:, 0] * k_scale, q[:, 1] * v_scale], dim=1).to(dtype)
