"""Llama-architecture decoder over a paged KV cache (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings).

One forward pass takes a flat batch of new tokens from several sequences (`ForwardBatch`,
built by runner.py): prompt chunks in a prefill pass, one token per sequence in a decode
pass. Each layer writes its new K/V into the pool before attending, so attention reads
cached prefix and new tokens alike from the pool. Weights use Hugging Face names at load
time (`load_hf_weights`); q/k/v and gate/up are fused into single matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from shared.engine.config import ModelConfig
from shared.engine.kernels import cpu_attention, fused
from shared.engine.kernels.torch_ref import kv_rows
from shared.engine.weights import Packed


@dataclass
class ForwardBatch:
    """Tensors of one forward pass. T = new tokens in the batch: first `num_decode` decode
    tokens (one per running sequence, D of them), then prompt chunks."""

    input_ids: torch.Tensor        # (T,)
    positions: torch.Tensor        # (T,)
    slots: torch.Tensor            # (T,) block * block_size + offset where each new KV goes
    logits_index: torch.Tensor     # (B_out,) rows of T whose next-token logits are wanted
    num_decode: int = 0
    # the decode tokens' sequences
    block_tables: torch.Tensor | None = None  # (D, max_blocks)
    context_lens: torch.Tensor | None = None  # (D,)
    # prompt chunks: (query start among the rows after the decode ones, query length, context
    # length, block table)
    chunks: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)
    kv_rows: torch.Tensor | None = None  # (T,) slots as rows of a layer's pool: set by the forward pass


LayerHook = Callable[[int], None]  # called with the layer index once its KV is in the pool


def linear(x: torch.Tensor, weight: torch.Tensor | Packed, min_rows: int = 16, max_rows: int = 256) -> torch.Tensor:
    """x (M, in) @ weight(out, in).T. On CPU, MKL runs skinny batches faster as (weight @ x.T).T
    (measured: 25% at M=32, 2x for the vocabulary projection at M=8, nothing from M=512 on,
    where the transposed copy then costs more than it saves). A `Packed` weight (the file's
    own blocks, weights.py) goes to its kernel."""
    if isinstance(weight, Packed):
        return weight.matmul(x)
    if x.device.type == "cpu" and min_rows <= x.shape[0] <= max_rows:
        return (weight @ x.t()).t().contiguous()
    return F.linear(x, weight)


class Projection(nn.Linear):
    """A bias-free linear layer whose weight may be kept `Packed` (weights.py) instead of fp32."""

    packed: Packed | None = None

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    @property
    def matrix(self) -> torch.Tensor | Packed:
        return self.weight if self.packed is None else self.packed

    def pack(self, packed: Packed) -> None:
        """Compute with `packed` from now on; the fp32 weight is let go."""
        if packed.shape != tuple(self.weight.shape):
            raise ValueError(f"packed weight {packed.shape} for a {tuple(self.weight.shape)} projection")
        self.packed = packed
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)


def product(x: torch.Tensor, proj: Projection, norm: RMSNorm | None = None, swiglu: bool = False,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + f(x) @ proj.T, f the step before the product: `norm`, or `swiglu` (x is (gate,
    up) side by side: silu(gate)·up). A packed projection's kernel does f and the residual add
    itself, as one pass over the row; fp32 ones do them in torch."""
    w = proj.matrix
    if isinstance(w, Packed):
        return w.matmul(x, residual, None if norm is None else (norm.weight, norm.eps), swiglu)
    if norm is not None:
        x = norm(x)
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = linear(x, w)
    return y if residual is None else residual + y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in fp32 whatever the weight dtype, as the reference implementation does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    cos: torch.Tensor  # (max_pos, hd) buffers
    sin: torch.Tensor  # its first half negated: rotate-half's sign, so a rotation is 4 ops

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32)
                                              / cfg.head_dim))
        freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)                   # (max_pos, hd)
        self.register_buffer("cos", emb.cos(), persistent=False)
        sin = emb.sin()
        sin[:, :cfg.head_dim // 2].neg_()
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, 1, hd) for the batch's positions: looked up once per forward pass."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, heads, hd), rotate-half convention: x·cos + (−x2, x1)·sin, with the sign in the
        table (−x2·sin and x2·(−sin) are the same float)."""
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2, x1)
        return x * cos + swapped * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Projection(cfg.hidden_size, (self.h + 2 * self.kvh) * self.hd)
        self.o_proj = Projection(self.h * self.hd, cfg.hidden_size)
        self.scale = self.hd ** -0.5

    def forward(self, x: torch.Tensor, norm: RMSNorm, batch: ForwardBatch, pool: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], ops: SimpleNamespace) -> torch.Tensor:
        """x + attention(norm(x)): the residual stream after this block. Decode rows and prompt
        rows (a mixed pass has both) each take their own attention, then one o_proj product."""
        qkv = product(x, self.qkv_proj, norm=norm)
        d, rows = batch.num_decode, batch.kv_rows
        assert rows is not None  # (set by the model's forward)
        parts = []
        if d:
            parts.append(self._decode(qkv[:d], batch, pool, rows[:d], rope[0][:d], rope[1][:d], ops))
        if d < x.shape[0]:
            parts.append(self._prefill(qkv[d:], batch, pool, rows[d:], rope[0][d:], rope[1][d:], ops))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return product(out, self.o_proj, residual=x)

    def _split(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q (T, h, hd), k and v (T, kvh, hd), q and k rotated."""
        t, qk = qkv.shape[0], (self.h + self.kvh) * self.hd
        rotated = Rotary.rotate(qkv[:, :qk].view(t, self.h + self.kvh, self.hd), cos, sin)
        return rotated[:, :self.h], rotated[:, self.h:], qkv[:, qk:].view(t, self.kvh, self.hd)

    def _decode(self, qkv: torch.Tensor, batch: ForwardBatch, pool: torch.Tensor, rows: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        """One token per sequence against its paged context: (D, h·hd)."""
        if ops.decode_attention is not None and cpu_attention.usable(pool, qkv, cos, sin):
            return ops.decode_attention(qkv, cos, sin, pool, rows, batch.block_tables, batch.context_lens,
                                        self.h, self.scale)
        q, k, v = self._split(qkv, cos, sin)
        ops.write_kv(pool, rows, k, v)
        out = ops.paged_decode_attention(q, pool, batch.block_tables, batch.context_lens, self.scale)
        return out.reshape(qkv.shape[0], self.h * self.hd)

    def _prefill(self, qkv: torch.Tensor, batch: ForwardBatch, pool: torch.Tensor, rows: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        """Prompt chunks, each causal over its cached prefix and itself: (P, h·hd)."""
        q, k, v = self._split(qkv, cos, sin)
        ops.write_kv(pool, rows, k, v)
        out = torch.empty_like(q)
        for start, n, ctx, table in batch.chunks:
            if ctx == n:  # no cached prefix: attend over the fresh K/V directly
                out[start:start + n] = ops.causal_attention(
                    q[start:start + n], k[start:start + n], v[start:start + n], self.scale)
            else:
                out[start:start + n] = ops.paged_prefill_attention(q[start:start + n], pool, table, ctx, self.scale)
        return out.view(qkv.shape[0], self.h * self.hd)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Projection(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Projection(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """x + mlp(norm(x)): the residual stream after this block."""
        return product(product(x, self.gate_up_proj, norm=norm), self.down_proj, swiglu=True, residual=x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_embeddings else Projection(cfg.hidden_size, cfg.vocab_size)
        self.rotary = Rotary(cfg)
        self.tied_head: Packed | None = None  # the tied embedding matrix packed for the vocabulary projection
        self.packed_layers: fused.Layers | None = None  # every layer packed: decode passes in one C call
        self.fuse = True  # (tests turn it off to compare with the per-layer path)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pools: torch.Tensor, ops: SimpleNamespace,
                layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Returns next-token logits (B_out, vocab) in fp32 for `batch.logits_index`.

        kv_pools: (layers, num_blocks, 2, block_size, kv_heads, head_dim).
        """
        x = self.embed_tokens(batch.input_ids)                   # (T, D)
        batch.kv_rows = kv_rows(batch.slots, kv_pools.shape[3])  # once, not once a layer
        if self._fused_decode(batch, x, kv_pools, ops, layer_hook):
            assert self.packed_layers is not None
            x = fused.decode_layers(self.packed_layers, x, self.rotary.cos[batch.positions],
                                    self.rotary.sin[batch.positions], kv_pools, batch.kv_rows,
                                    cast(torch.Tensor, batch.block_tables), cast(torch.Tensor, batch.context_lens),
                                    self.cfg.num_heads, self.cfg.head_dim ** -0.5)
        else:
            rope = self.rotary.tables(batch.positions, x.dtype)
            for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.layers)):
                x = layer.self_attn(x, layer.input_layernorm, batch, kv_pools[i], rope, ops)
                x = layer.mlp(x, layer.post_attention_layernorm)
                if layer_hook is not None:
                    layer_hook(i)
        x = self.norm(x[batch.logits_index])
        if self.lm_head is not None:
            weight = self.lm_head.matrix
        else:  # (the embedding lookup keeps its fp32 rows: a lookup streams only the rows it reads)
            weight = self.embed_tokens.weight if self.tied_head is None else self.tied_head
        return linear(x, weight, min_rows=2).float()

    def _fused_decode(self, batch: ForwardBatch, x: torch.Tensor, kv_pools: torch.Tensor, ops: SimpleNamespace,
                      layer_hook: LayerHook | None) -> bool:
        """Whether this pass's layers run as one C call (kernels/fused.py): a decode pass (no
        prompt rows), every projection packed, the C attention backend, fp32 on CPU, and no
        layer hook (nothing to call between layers)."""
        return (self.packed_layers is not None and self.fuse and not batch.chunks and batch.num_decode > 0
                and layer_hook is None and ops.decode_attention is not None
                and cpu_attention.usable(kv_pools, x))

    def pack(self, packed: dict[str, Packed]) -> None:
        """Compute with these packed matrices (Hugging Face names, as `load_hf_weights` takes
        them) instead of the fp32 ones; q/k/v and gate/up are stacked as their projections are."""
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.layers)):
            p = f"model.layers.{i}."
            parts = {"self_attn.qkv_proj": [f"self_attn.{n}_proj" for n in "qkv"],
                     "self_attn.o_proj": ["self_attn.o_proj"],
                     "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"], "mlp.down_proj": ["mlp.down_proj"]}
            for own, names in parts.items():
                if all(p + n + ".weight" in packed for n in names):
                    cast(Projection, layer.get_submodule(own)).pack(Packed.cat([packed[p + n + ".weight"]
                                                                                for n in names]))
        self.packed_layers = self._layers_packed()
        if self.lm_head is not None and "lm_head.weight" in packed:
            self.lm_head.pack(packed["lm_head.weight"])
        elif self.lm_head is None and "model.embed_tokens.weight" in packed:
            self.tied_head = packed["model.embed_tokens.weight"]

    def _layers_packed(self) -> fused.Layers | None:
        """Every layer's weights for fused.c, or None unless all four projections of every
        layer are packed (a file with some matrices in another format keeps the per-layer path)."""
        layers: list[tuple[tuple, torch.Tensor, torch.Tensor]] = []
        for layer in cast("Iterable[DecoderLayer]", self.layers):
            projs = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if any(p.packed is None for p in projs):
                return None
            layers.append((tuple(p.packed for p in projs), layer.input_layernorm.weight,
                           layer.post_attention_layernorm.weight))
        return fused.Layers.of(layers, self.cfg.hidden_size, self.cfg.intermediate_size, self.cfg.rms_norm_eps)

    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face Llama names (`model.layers.N.self_attn.q_proj.weight`, …)."""
        own = {}
        for name, t in tensors.items():
            name = name.removeprefix("model.")
            if name == "lm_head.weight":
                if self.lm_head is not None:
                    own["lm_head.weight"] = t
                continue
            own[name] = t
        for i in range(self.cfg.num_layers):
            p = f"layers.{i}."
            own[p + "self_attn.qkv_proj.weight"] = torch.cat(
                [own.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            own[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [own.pop(p + "mlp.gate_proj.weight"), own.pop(p + "mlp.up_proj.weight")])
        own.pop("rotary_emb.inv_freq", None)
        missing, unexpected = self.load_state_dict(own, strict=False)
        missing = [m for m in missing if not m.startswith("rotary.")]
        if missing or unexpected:
            raise ValueError(f"weights do not match the architecture: missing {missing}, "
                             f"unexpected {unexpected}")
