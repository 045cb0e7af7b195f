"""The decoder over a paged KV cache: Llama's layer (RMSNorm, RoPE, GQA, SwiGLU, tied or untied
embeddings) and the few places where Qwen2/3, Mistral, Phi-3 and Gemma 2/3 differ from it, each
a field of `ModelConfig` read where it applies: q/k/v biases, q/k norms, partial rotary, a
sliding window per layer (with its own RoPE for Gemma 3), soft-capped scores and logits,
GeGLU, Gemma's (1 + w) norms around both blocks and its scaled embeddings.

One forward pass takes a flat batch of new tokens from several sequences (`ForwardBatch`,
built by runner.py): prompt chunks in a prefill pass, one token per sequence in a decode
pass. Each layer writes its new K/V into the pool before attending, so attention reads
cached prefix and new tokens alike from the pool. Weights use Hugging Face names at load
time (`load_hf_weights`); q/k/v and gate/up are fused into single matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from shared.engine.config import ModelConfig
from shared.engine.kernels import cpu_attention, fused
from shared.engine.kernels.torch_ref import kv_rows, softcapped
from shared.engine.rope import Rope
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
    """A linear layer whose weight may be kept `Packed` (weights.py) instead of fp32."""

    packed: Packed | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)

    @property
    def matrix(self) -> torch.Tensor | Packed:
        return self.weight if self.packed is None else self.packed

    def pack(self, packed: Packed) -> None:
        """Compute with `packed` from now on; the fp32 weight is let go."""
        if self.bias is not None:
            raise ValueError("a projection with a bias is not packed")
        if packed.shape != tuple(self.weight.shape):
            raise ValueError(f"packed weight {packed.shape} for a {tuple(self.weight.shape)} projection")
        self.packed = packed
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)


_GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


def product(x: torch.Tensor, proj: Projection, norm: RMSNorm | None = None, gate: str = "",
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + f(x) @ proj.T (+ its bias), f the step before the product: `norm`, or a
    `gate` (x is (gate, up) side by side: act(gate)·up, act silu or gelu_tanh). A packed
    projection's kernel does f and the residual add itself, as one pass over the row (SwiGLU
    only); other ones do them in torch."""
    w = proj.matrix
    if isinstance(w, Packed):
        assert gate in ("", "silu") and proj.bias is None  # (ModelConfig.plain: nothing else is packed)
        return w.matmul(x, residual, None if norm is None else (norm.weight, norm.eps), gate == "silu")
    if norm is not None:
        x = norm(x)
    if gate:
        g, up = x.chunk(2, dim=-1)
        x = _GATES[gate](g) * up
    y = linear(x, w)
    if proj.bias is not None:
        y = y + proj.bias
    return y if residual is None else residual + y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.plus_one = eps, plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalized in fp32 whatever the weight dtype, as the reference implementations do;
        # Llama scales in x's dtype, Gemma (weights as offsets from 1) in fp32
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    cos: torch.Tensor  # (max_pos, rotary dims) buffers, times the scaling's attention factor
    sin: torch.Tensor  # its first half negated: rotate-half's sign, so a rotation is 4 ops

    def __init__(self, cfg: ModelConfig, rope: Rope):
        super().__init__()
        dim = cfg.rotary_dim or cfg.head_dim
        inv_freq, factor = rope.frequencies(dim, cfg.max_position)
        freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)                   # (max_pos, dim)
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        sin = emb.sin() * factor
        sin[:, :dim // 2].neg_()
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


RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin (T, 1, rotary dims) at the batch's positions


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.h, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Projection(cfg.hidden_size, (self.h + 2 * self.kvh) * self.hd, cfg.qkv_bias)
        self.o_proj = Projection(self.h * self.hd, cfg.hidden_size, cfg.o_bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.norm_plus_one) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.norm_plus_one) if cfg.qk_norm else None
        self.scale, self.softcap, self.window = cfg.scale, cfg.attn_softcap, cfg.window(layer)
        self.rotary_dim = cfg.rotary_dim or self.hd
        self.local = bool(self.window) and cfg.local_rope is not None  # takes the local RoPE tables
        self.plain = cfg.plain  # what the C decode attention computes

    def forward(self, x: torch.Tensor, norm: RMSNorm, batch: ForwardBatch, pool: torch.Tensor,
                rope: RopeTables, ops: SimpleNamespace, post_norm: RMSNorm | None = None) -> torch.Tensor:
        """x + post_norm(attention(norm(x))): the residual stream after this block. Decode rows
        and prompt rows (a mixed pass has both) each take their own attention, then one o_proj
        product."""
        qkv = product(x, self.qkv_proj, norm=norm)
        d, rows = batch.num_decode, batch.kv_rows
        assert rows is not None  # (set by the model's forward)
        parts = []
        if d:
            parts.append(self._decode(qkv[:d], batch, pool, rows[:d], rope[0][:d], rope[1][:d], ops))
        if d < x.shape[0]:
            parts.append(self._prefill(qkv[d:], batch, pool, rows[d:], rope[0][d:], rope[1][d:], ops))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if post_norm is None:
            return product(out, self.o_proj, residual=x)
        return x + post_norm(product(out, self.o_proj))

    def _split(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q (T, h, hd), k and v (T, kvh, hd), q and k normed (where the model does) and rotated
        (their first rotary_dim dimensions)."""
        t, qk = qkv.shape[0], (self.h + self.kvh) * self.hd
        heads = qkv[:, :qk].view(t, self.h + self.kvh, self.hd)
        if self.q_norm is not None and self.k_norm is not None:
            heads = torch.cat([self.q_norm(heads[:, :self.h]), self.k_norm(heads[:, self.h:])], dim=1)
        if self.rotary_dim == self.hd:
            rotated = Rotary.rotate(heads, cos, sin)
        else:
            rd = self.rotary_dim
            rotated = torch.cat([Rotary.rotate(heads[..., :rd], cos, sin), heads[..., rd:]], dim=-1)
        return rotated[:, :self.h], rotated[:, self.h:], qkv[:, qk:].view(t, self.kvh, self.hd)

    def _decode(self, qkv: torch.Tensor, batch: ForwardBatch, pool: torch.Tensor, rows: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        """One token per sequence against its paged context: (D, h·hd)."""
        if ops.decode_attention is not None and self.plain and cpu_attention.usable(pool, qkv, cos, sin):
            return ops.decode_attention(qkv, cos, sin, pool, rows, batch.block_tables, batch.context_lens,
                                        self.h, self.scale)
        q, k, v = self._split(qkv, cos, sin)
        ops.write_kv(pool, rows, k, v)
        out = ops.paged_decode_attention(q, pool, batch.block_tables, batch.context_lens, self.scale,
                                         self.window, self.softcap)
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
                    q[start:start + n], k[start:start + n], v[start:start + n], self.scale, self.window, self.softcap)
            else:
                out[start:start + n] = ops.paged_prefill_attention(q[start:start + n], pool, table, ctx, self.scale,
                                                                   self.window, self.softcap)
        return out.view(qkv.shape[0], self.h * self.hd)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Projection(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Projection(cfg.intermediate_size, cfg.hidden_size)
        self.gate = cfg.activation

    def forward(self, x: torch.Tensor, norm: RMSNorm, post_norm: RMSNorm | None = None) -> torch.Tensor:
        """x + post_norm(mlp(norm(x))): the residual stream after this block."""
        up = product(x, self.gate_up_proj, norm=norm)
        if post_norm is None:
            return product(up, self.down_proj, gate=self.gate, residual=x)
        return x + post_norm(product(up, self.down_proj, gate=self.gate))


class DecoderLayer(nn.Module):
    """Hugging Face's module names: Llama's two norms are `input_layernorm` (before attention)
    and `post_attention_layernorm` (before the MLP); Gemma's four, one before and one after each
    block, are `input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm` and
    `post_feedforward_layernorm`."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(cfg)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: torch.Tensor, rope: RopeTables,
                ops: SimpleNamespace) -> torch.Tensor:
        if self.sandwich:
            x = self.self_attn(x, self.input_layernorm, batch, pool, rope, ops, self.post_attention_layernorm)
            return self.mlp(x, self.pre_feedforward_layernorm, self.post_feedforward_layernorm)
        x = self.self_attn(x, self.input_layernorm, batch, pool, rope, ops)
        return self.mlp(x, self.post_attention_layernorm)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.lm_head = None if cfg.tie_embeddings else Projection(cfg.hidden_size, cfg.vocab_size)
        self.make_rotary()
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
        if self.cfg.embed_scale != 1.0:  # (in the weights' dtype, as Gemma's reference does)
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        batch.kv_rows = kv_rows(batch.slots, kv_pools.shape[3])  # once, not once a layer
        if self._fused_decode(batch, x, kv_pools, ops, layer_hook):
            assert self.packed_layers is not None
            x = fused.decode_layers(self.packed_layers, x, self.rotary.cos[batch.positions],
                                    self.rotary.sin[batch.positions], kv_pools, batch.kv_rows,
                                    cast(torch.Tensor, batch.block_tables), cast(torch.Tensor, batch.context_lens),
                                    self.cfg.num_heads, self.cfg.scale)
        else:
            rope = self.rotary.tables(batch.positions, x.dtype)
            local = rope if self.local_rotary is None else self.local_rotary.tables(batch.positions, x.dtype)
            for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.layers)):
                x = layer(x, batch, kv_pools[i], local if layer.self_attn.local else rope, ops)
                if layer_hook is not None:
                    layer_hook(i)
        x = self.norm(x[batch.logits_index])
        if self.lm_head is not None:
            weight = self.lm_head.matrix
        else:  # (the embedding lookup keeps its fp32 rows: a lookup streams only the rows it reads)
            weight = self.embed_tokens.weight if self.tied_head is None else self.tied_head
        return softcapped(linear(x, weight, min_rows=2).float(), self.cfg.final_softcap)

    def make_rotary(self, device: str | torch.device | None = None) -> None:
        """The RoPE tables (fp32 buffers, not weights): the global layers', and the local
        (sliding-window) layers' where their RoPE differs; made on `device` (default: the
        current one)."""
        with torch.device(device) if device is not None else nullcontext():
            self.rotary = Rotary(self.cfg, self.cfg.rope)
            self.local_rotary = None if self.cfg.local_rope is None else Rotary(self.cfg, self.cfg.local_rope)

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
        """Every layer's weights for fused.c, or None unless the layers are Llama's and all four
        projections of every layer are packed (a file with some matrices in another format keeps
        the per-layer path)."""
        if not self.cfg.plain:
            return None
        layers: list[tuple[tuple, torch.Tensor, torch.Tensor]] = []
        for layer in cast("Iterable[DecoderLayer]", self.layers):
            projs = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if any(p.packed is None for p in projs):
                return None
            layers.append((tuple(p.packed for p in projs), layer.input_layernorm.weight,
                           layer.post_attention_layernorm.weight))
        return fused.Layers.of(layers, self.cfg.hidden_size, self.cfg.intermediate_size, self.cfg.rms_norm_eps)

    def load_hf_weights(self, shards: Iterable[dict[str, torch.Tensor]]) -> None:
        """Load Hugging Face names (`model.layers.N.self_attn.q_proj.weight`, …), one shard at a
        time (each is copied into the model before the next is read): q/k/v and gate/up
        separate (their biases too, fused once all parts have come, in whichever shards) or
        already fused (Phi-3's `qkv_proj`, `gate_up_proj`)."""
        fused_from = {"self_attn.qkv_proj": [f"self_attn.{n}_proj" for n in "qkv"],
                      "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}
        waiting: dict[str, torch.Tensor] = {}  # parts of a fused projection whose siblings are still to come
        loaded: set[str] = set()
        unexpected: list[str] = []
        for tensors in shards:
            own: dict[str, torch.Tensor] = {}
            for name, t in tensors.items():
                name = name.removeprefix("model.")
                if name == "lm_head.weight" and self.lm_head is None:
                    continue  # (tied: the embedding is the head)
                if name != "rotary_emb.inv_freq":
                    (waiting if _fused_part(name, fused_from) else own)[name] = t
            for i in range(self.cfg.num_layers):
                for kind in ("weight", "bias"):
                    for fused_name, parts in fused_from.items():
                        names = [f"layers.{i}.{n}.{kind}" for n in parts]
                        if all(n in waiting for n in names):
                            own[f"layers.{i}.{fused_name}.{kind}"] = torch.cat([waiting.pop(n) for n in names])
            unexpected += self.load_state_dict(own, strict=False).unexpected_keys
            loaded |= own.keys()
        missing = [k for k in self.state_dict() if k not in loaded and not k.startswith(("rotary.", "local_rotary."))]
        if missing or unexpected or waiting:
            raise ValueError(f"weights do not match the architecture: missing {missing}, "
                             f"unexpected {unexpected + sorted(waiting)}")


def _fused_part(name: str, fused_from: dict[str, list[str]]) -> bool:
    """Whether `name` (layers.N.<module>.<weight|bias>) is one part of a projection the model fuses."""
    module = name.split(".", 2)[-1].rsplit(".", 1)[0] if name.startswith("layers.") else ""
    return any(module in parts for parts in fused_from.values())
