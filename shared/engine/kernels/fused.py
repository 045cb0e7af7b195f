"""A decode pass's decoder layers in one C call (fused.c, built by cc.py), for a model whose
every projection is `Packed` (PD_WEIGHTS=native) with an fp32 KV pool on CPU: the same
products, attention and residual adds as the model's per-layer path, without Python between
them. `Layers` holds the weights' addresses, made once when the model is packed."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from shared.engine.kernels import blocks, cc, cpu_attention

SOURCE = Path(__file__).with_name("fused.c")


@cache
def library(path: Path | None = None) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path or cc.build(SOURCE, includes=(blocks.SOURCE, *blocks.INCLUDES, cpu_attention.SOURCE))))
    lib.decode_layers.restype = ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.decode_layers.argtypes = [ptr, i64, ptr, i64, i64, ctypes.c_float, ptr, ptr, ptr, i64, ptr, ptr, ptr,
                                  i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    return lib


@dataclass(frozen=True)
class Layers:
    """Every layer's weights as fused.c reads them. `keep` holds the tensors the addresses
    point into, so they live as long as this does."""

    weights: torch.Tensor   # (layers, 42) int64: qkv, o, gate_up, down descriptors; input norm, post norm
    hidden: int
    intermediate: int
    eps: float
    keep: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, layers: list[tuple[tuple, torch.Tensor, torch.Tensor]], hidden: int, intermediate: int,
           eps: float) -> Layers:
        """layers: per layer ((qkv, o, gate_up, down) as `Packed`, input norm weight, post norm
        weight)."""
        keep, rows = [], []
        for mats, norm_in, norm_post in layers:
            norms = [norm_in.detach().contiguous(), norm_post.detach().contiguous()]
            keep += [t for m in mats for _, t in m.parts] + norms
            rows.append(torch.cat([*(m.descriptor for m in mats),
                                   torch.tensor([t.data_ptr() for t in norms], dtype=torch.int64)]))
        return cls(torch.stack(rows), hidden, intermediate, eps, tuple(keep))


def decode_layers(layers: Layers, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pools: torch.Tensor,
                  rows: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, heads: int,
                  scale: float) -> torch.Tensor:
    """x (B, hidden) fp32, one decode token per sequence, through every layer: returns the
    residual stream after the last (x is overwritten with it). cos, sin (B, head_dim) at each
    token's position (attention.Rotary's tables); pools (layers, blocks, 2, block_size, kv_heads,
    head_dim) fp32, contiguous: each layer's new K/V are written there; rows (B,)
    `torch_ref.kv_rows` of the new tokens."""
    b, kvh, hd = x.shape[0], pools.shape[4], pools.shape[5]
    for t in (x, cos, sin, pools):
        if t.dtype is not torch.float32 or not t.is_contiguous():
            raise ValueError(f"decode_layers takes contiguous float32 tensors, got {t.dtype} {tuple(t.shape)}")
    ints = [t.to(torch.int64).contiguous() for t in (rows, block_tables, context_lens)]
    rc = library().decode_layers(
        x.data_ptr(), layers.weights.shape[0], layers.weights.data_ptr(), layers.hidden,
        layers.intermediate, layers.eps, cos.data_ptr(), sin.data_ptr(), pools.data_ptr(), pools[0].numel(),
        *(t.data_ptr() for t in ints), b, heads, kvh, hd, pools.shape[3], ints[1].shape[1], scale,
        torch.get_num_threads())
    if rc == -2:
        raise ValueError("decode_layers: head_dim over 256 or widths not whole blocks of a matrix's formats")
    if rc != 0:
        raise MemoryError("decode_layers: out of memory for its scratch")
    return x
