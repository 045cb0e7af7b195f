"""The decoder over a paged KV cache: Llama's layer (RMSNorm, RoPE, GQA, SwiGLU, tied or untied
embeddings) and the few places where Qwen2/3, Mistral, Phi-3 and Gemma 2/3 differ from it, each
a field of `ModelConfig` read where it applies: q/k/v biases, q/k norms, partial rotary, a
sliding window per layer (with its own RoPE for Gemma 3), soft-capped scores and logits,
GeGLU, Gemma's (1 + w) norms around both blocks and its scaled embeddings.

One forward pass takes a flat batch of new tokens from several sequences (`ForwardBatch`,
batch.py): prompt chunks in a prefill pass, one token per sequence in a decode pass. Each
layer writes its new K/V into the pool before attending (attention.py), so attention reads
cached prefix and new tokens alike from the pool; its products are projection.py's. Weights
use Hugging Face names at load time (`load_hf_weights`); q/k/v and gate/up are fused into
single matmuls. `pack` swaps in a file's own blocks (weights.py), and a decode pass over
every layer packed runs as one C call (kernels/fused.py) for every architecture but those with
biases or partial rotary.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from contextlib import nullcontext
from functools import partial
from types import SimpleNamespace
from typing import cast

import torch
from torch import nn

from pdserve.shared.engine.attention import Attention, RopeTables, Rotary
from pdserve.shared.engine.batch import ForwardBatch, LayerHook
from pdserve.shared.engine.config import ModelConfig
from pdserve.shared.engine.kernels import cpu_attention, fused
from pdserve.shared.engine.kernels.torch_ref import kv_rows, softcapped
from pdserve.shared.engine.projection import Projection, RMSNorm, linear, product
from pdserve.shared.engine.weights import Packed


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


# each projection's matrices under their Hugging Face names, stacked along its output
_STACKED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
            "mlp.down_proj": ("mlp.down_proj",)}


def pack_plan(names: Collection[str], num_layers: int) -> dict[str, list[str]]:
    """Which of `names` (packed matrices, Hugging Face names) each projection computes with,
    by module path: a projection's parts when all are there, or the projection itself where
    the file holds it stacked (Phi-3's qkv and gate_up), and an untied vocabulary projection."""
    plan = {}
    for i in range(num_layers):
        for own, parts in _STACKED.items():
            for group in ((own,), parts):
                keys = [f"model.layers.{i}.{n}.weight" for n in group]
                if all(k in names for k in keys):
                    plan[f"layers.{i}.{own}"] = keys
                    break
    if "lm_head.weight" in names:
        plan["lm_head"] = ["lm_head.weight"]
    return plan


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # (no op here runs on the meta device the loader builds on: there the embedding's random init and
        # the RoPE tables' ops would import torch's compiler, seconds of a worker's start)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.lm_head = None if cfg.tie_embeddings else Projection(cfg.hidden_size, cfg.vocab_size)
        self.make_rotary("cpu")  # (made again on the model's device by the loader)
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
            rope = self.rotary.cos[batch.positions], self.rotary.sin[batch.positions]
            local = rope if self.local_rotary is None else (self.local_rotary.cos[batch.positions],
                                                            self.local_rotary.sin[batch.positions])
            x = fused.decode_layers(self.packed_layers, x, rope, local, kv_pools, batch.kv_rows,
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
                and cpu_attention.usable(kv_pools[0], x))

    def pack(self, packed: dict[str, Packed]) -> None:
        """Compute with these packed matrices (Hugging Face names, as `load_hf_weights` takes
        them) instead of the fp32 ones, as `pack_plan` stacks them."""
        for own, names in pack_plan(packed, self.cfg.num_layers).items():
            cast(Projection, self.get_submodule(own)).pack(Packed.cat([packed[n] for n in names]))
        self.packed_layers = self._layers_packed()
        if self.lm_head is None and "model.embed_tokens.weight" in packed:
            self.tied_head = packed["model.embed_tokens.weight"]

    def packed_formats(self) -> set[str]:
        """The block formats of the matrices computed with as the file's blocks."""
        mats = [m.packed for m in self.modules() if isinstance(m, Projection) and m.packed is not None]
        return {k for p in [*mats, *([self.tied_head] if self.tied_head else [])] for k in p.formats}

    def _layers_packed(self) -> fused.Layers | None:
        """Every layer's weights for fused.c, or None unless the layers are ones it computes
        (`cfg.fusable`) and all four projections of every layer are packed (a file with some
        matrices in another format keeps the per-layer path)."""
        if not self.cfg.fusable:
            return None
        layers: list[fused.Layer] = []
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.layers)):
            attn = layer.self_attn
            projs = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if any(p.packed is None for p in projs):
                return None
            if layer.sandwich:  # Gemma: a norm before and after each block
                norms = {"mlp_norm": layer.pre_feedforward_layernorm.weight,
                         "attn_out_norm": layer.post_attention_layernorm.weight,
                         "mlp_out_norm": layer.post_feedforward_layernorm.weight}
            else:
                norms = {"mlp_norm": layer.post_attention_layernorm.weight}
            if attn.q_norm is not None and attn.k_norm is not None:
                norms |= {"q_norm": attn.q_norm.weight, "k_norm": attn.k_norm.weight}
            layers.append(fused.Layer(tuple(p.packed for p in projs), layer.input_layernorm.weight, **norms,
                                      window=self.cfg.window(i), local=attn.local))
        return fused.Layers.of(layers, self.cfg.hidden_size, self.cfg.intermediate_size, self.cfg.rms_norm_eps,
                               self.cfg.norm_plus_one, self.cfg.activation, self.cfg.attn_softcap)

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
