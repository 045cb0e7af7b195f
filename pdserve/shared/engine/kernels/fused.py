"""A decode pass's decoder layers in one C call (fused.c, built by cc.py), for a model whose
every projection is `Packed` (PD_WEIGHTS=native) with an fp32 KV pool on CPU: the same
products, norms, attention and residual adds as the model's per-layer path, without Python
between them. `Layers` holds the weights' addresses, made once when the model is packed."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from pdserve.shared.engine.kernels import blocks, cc, cpu_attention

SOURCE = Path(__file__).with_name("fused.c")


class Arch(ctypes.Structure):
    """fused.c's `struct arch`: the settings every layer shares."""

    _fields_ = [("eps", ctypes.c_float), ("softcap", ctypes.c_float), ("plus_one", ctypes.c_int),
                ("gate", ctypes.c_int)]


@cache
def library(path: Path | None = None) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path or cc.build(SOURCE, includes=(blocks.SOURCE, *blocks.INCLUDES, cpu_attention.SOURCE))))
    lib.decode_layers.restype = ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.decode_layers.argtypes = [ptr, i64, ptr, i64, i64, Arch, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr,
                                  i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    return lib


@dataclass(frozen=True)
class Layer:
    """One layer as fused.c takes it: its four projections (qkv, o, gate_up, down) as `Packed`,
    its norms' weights (None where the layer has none), its window (0: the whole context) and
    whether it takes the local RoPE tables."""

    mats: tuple
    in_norm: torch.Tensor
    mlp_norm: torch.Tensor
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = 0
    local: bool = False


@dataclass(frozen=True)
class Layers:
    """Every layer's weights as fused.c reads them. `keep` holds the tensors the addresses
    point into, so they live as long as this does."""

    weights: torch.Tensor   # (layers, 48) int64: qkv, o, gate_up, down descriptors; 6 norms, window, local
    hidden: int
    intermediate: int
    arch: Arch
    keep: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, layers: list[Layer], hidden: int, intermediate: int, eps: float, plus_one: bool = False,
           gate: str = "silu", softcap: float = 0.0) -> Layers:
        keep, rows = [], []
        for layer in layers:
            norms = [None if t is None else t.detach().float().contiguous()
                     for t in (layer.in_norm, layer.mlp_norm, layer.attn_out_norm, layer.mlp_out_norm, layer.q_norm,
                               layer.k_norm)]
            keep += [t for m in layer.mats for _, t in m.parts] + [t for t in norms if t is not None]
            extra = [0 if t is None else t.data_ptr() for t in norms] + [layer.window, int(layer.local)]
            rows.append(torch.cat([*(m.descriptor for m in layer.mats), torch.tensor(extra, dtype=torch.int64)]))
        return cls(torch.stack(rows), hidden, intermediate, Arch(eps, softcap, int(plus_one), blocks.GATES[gate]),
                   tuple(keep))


def decode_layers(layers: Layers, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  local_rope: tuple[torch.Tensor, torch.Tensor], pools: torch.Tensor, rows: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """x (B, hidden) fp32, one decode token per sequence, through every layer: returns the
    residual stream after the last (x is overwritten with it). rope, local_rope: cos, sin
    (B, head_dim) at each token's position (attention.Rotary's tables; the local ones for the
    sliding-window layers that take them); pools (layers, blocks, 2, block_size, kv_heads,
    head_dim) fp32, contiguous: each layer's new K/V are written there; rows (B,)
    `torch_ref.kv_rows` of the new tokens."""
    b, kvh, hd = x.shape[0], pools.shape[4], pools.shape[5]
    for t in (x, *rope, *local_rope, pools):
        if t.dtype is not torch.float32 or not t.is_contiguous():
            raise ValueError(f"decode_layers takes contiguous float32 tensors, got {t.dtype} {tuple(t.shape)}")
    ints = [t.to(torch.int64).contiguous() for t in (rows, block_tables, context_lens)]
    rc = library().decode_layers(
        x.data_ptr(), layers.weights.shape[0], layers.weights.data_ptr(), layers.hidden, layers.intermediate,
        layers.arch, *(t.data_ptr() for t in (*rope, *local_rope)), pools.data_ptr(), pools[0].numel(),
        *(t.data_ptr() for t in ints), b, heads, kvh, hd, pools.shape[3], ints[1].shape[1], scale,
        torch.get_num_threads())
    if rc == -2:
        raise ValueError("decode_layers: head_dim over 256 or widths not whole blocks of a matrix's formats")
    if rc != 0:
        raise MemoryError("decode_layers: out of memory for its scratch")
    return x
