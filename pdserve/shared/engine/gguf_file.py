"""A GGUF file as the engine's: its architecture, its tensors under Hugging Face names, its tokenizer.

- `config`: the file's metadata for its architecture (llama.cpp's keys, renamed as transformers
  renames them: `GGUF_CONFIG_MAPPING`) given to that architecture's transformers config class,
  which fills in what a GGUF does not carry (Gemma 3's layer pattern, local RoPE base, query
  scale), then architectures.model_config as for a directory.
- `tensors`: every tensor dequantized (any format gguf-py reads: Q4_0…Q8_0, K-quants, F16, F32)
  under its Hugging Face name, undoing what llama.cpp's converter did: q/k rows interleaved
  for its RoPE (Llama and Mistral files), 1 added to Gemma's norm weights.

What a GGUF does not carry comes from llama.cpp's rules, not transformers' defaults: a file
without `attention.sliding_window` (Mistral's, written as `llama`) attends to the whole context;
Gemma's query scale is 1/sqrt(head_dim) (hidden/heads for the 27B models); Gemma 3's layers are
5 local to 1 global (transformers' default pattern too).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from pdserve.shared.engine import gguf_tensors
from pdserve.shared.engine.architectures import ARCHITECTURES, model_config
from pdserve.shared.engine.config import ModelConfig
from pdserve.shared.engine.gguf_tensors import FileTensor, metadata
from pdserve.shared.engine.model import pack_plan
from pdserve.shared.engine.rope import Rope
from pdserve.shared.engine.weights import Packed, pack
from pdserve.shared.progress import progress

# blk.N.<kind> -> the layer's Hugging Face module (Gemma's ffn_norm is its pre-feedforward norm)
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}  # 27B: queries scaled by hidden/heads, not head_dim
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # GGUF architecture -> transformers model_type, where they differ


def model_type(meta: dict) -> str:
    arch = meta["general.architecture"]
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        return "mistral"  # llama.cpp writes Mistral as llama (transformers reads it back as mistral)
    return _MODEL_TYPES.get(arch, arch)


def config(path: Path, file_tensors: list[FileTensor] | None = None) -> ModelConfig:
    """The file's architecture as the engine's config. A file with `rope_freqs.weight` (Llama 3.1's
    RoPE scaling, as llama.cpp's converter stores it) has its factors read from the tensors
    (`file_tensors`, or the file's read here)."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    meta, names = metadata(path)
    arch, mtype = meta["general.architecture"], model_type(meta)
    if mtype not in ARCHITECTURES or arch not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    renames = cast(dict[str, str | None], GGUF_CONFIG_MAPPING[arch])
    kwargs = {hf: meta[f"{arch}.{key}"] for key, hf in renames.items() if hf is not None and f"{arch}.{key}" in meta}
    kwargs.setdefault("vocab_size", meta["tokenizer.ggml.tokens"])  # (the vocabulary's length)
    window = meta.get(f"{arch}.attention.sliding_window")
    kwargs["sliding_window"] = int(window) if window else None  # none where the file has none, as llama.cpp
    if (key_length := meta.get(f"{arch}.attention.key_length")) is not None:
        kwargs["head_dim"] = int(key_length)  # (transformers' mapping misses it for Qwen3, Phi-3)
    head_dim = kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"]
    if (rotated := meta.get(f"{arch}.rope.dimension_count")) and rotated < head_dim:
        kwargs["partial_rotary_factor"] = rotated / head_dim  # Phi-3
    if mtype in _GEMMA_27B_LAYERS:  # a GGUF has no query scale: llama.cpp's rule (llama-model.cpp)
        big = kwargs["num_hidden_layers"] == _GEMMA_27B_LAYERS[mtype]
        kwargs["query_pre_attn_scalar"] = kwargs["hidden_size"] // kwargs["num_attention_heads"] if big else head_dim
    for key in ("bos", "eos", "padding"):
        if (token := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            kwargs["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token)
    try:
        cfg = model_config(AutoConfig.for_model(mtype, tie_word_embeddings="output.weight" not in names, **kwargs))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    factors = _rope_factors(path, file_tensors) if "rope_freqs.weight" in names else None
    rope = _rope(meta, arch, cfg.rope.theta, factors, path)
    local = meta.get(f"{arch}.rope.freq_base_swa")
    return replace(cfg, rope=rope, local_rope=Rope(float(local)) if cfg.local_rope and local else cfg.local_rope)


def _rope(meta: dict, arch: str, theta: float, factors: tuple[float, ...] | None, path: Path) -> Rope:
    """The file's RoPE (its global layers' for Gemma 3), from llama.cpp's `rope.scaling.*` keys
    (none, linear, yarn) or a `rope_freqs.weight` of factors."""
    def key(name: str) -> Any:
        return meta.get(f"{arch}.rope.scaling.{name}")

    kind = key("type") or "none"
    if factors is not None and kind == "none":
        return Rope(theta, "factors", (("factors", factors),))
    if kind == "linear" and factors is None:
        return Rope(theta, "linear", (("factor", float(key("factor"))),))
    if kind == "yarn" and factors is None and key("yarn_ext_factor") in (None, 1.0):
        params = {"factor": key("factor"), "original_max_position_embeddings": key("original_context_length"),
                  "attention_factor": key("yarn_attn_factor"), "beta_fast": key("yarn_beta_fast"),
                  "beta_slow": key("yarn_beta_slow")}
        return Rope(theta, "yarn", tuple(sorted((k, v) for k, v in params.items() if v is not None)))
    if kind == "none":
        return Rope(theta)
    raise ValueError(f"{path}: RoPE scaling {kind!r} (rope_freqs.weight: {factors is not None}) is not supported")


def _rope_factors(path: Path, file_tensors: list[FileTensor] | None) -> tuple[float, ...]:
    import gguf

    t = next(t for t in file_tensors or gguf_tensors.tensors(path) if t.name == "rope_freqs.weight")
    return tuple(float(f) for f in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows interleaved for its RoPE; undo it for rotate-half."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _as_is(w: np.ndarray) -> np.ndarray:
    return w


def hf_name(name: str, cfg: ModelConfig) -> str:
    """A GGUF tensor's Hugging Face name (`blk.3.ffn_up.weight` -> `model.layers.3.mlp.up_proj.weight`)."""
    parts = name.split(".")
    if parts[0] == "blk":
        _, layer, kind, suffix = parts
        if kind == "ffn_norm" and cfg.sandwich_norms:
            own = "pre_feedforward_layernorm"
        elif kind == "ffn_up" and cfg.arch == "phi3":
            own = "mlp.gate_up_proj"  # Phi-3's gate and up are one tensor in its files too
        else:
            own = _LAYER_NAMES[kind]
        return f"model.layers.{layer}.{own}.{suffix}"
    *base, suffix = parts
    return f"{_MODEL_NAMES['.'.join(base)]}.{suffix}"


def _dequantize(t: FileTensor) -> np.ndarray:
    """A tensor in fp32: Q8_0 (the usual embedding table's format, 262k rows for Gemma 3) in a
    few whole-array steps, where gguf-py's walk over row groups took 5 s; anything else by
    gguf-py."""
    import gguf

    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        blocks = t.data.reshape(-1, 34)
        w = blocks[:, 2:].view(np.int8).astype(np.float32) * blocks[:, :2].view(np.float16).astype(np.float32)
        return w.reshape(*t.data.shape[:-1], t.data.shape[-1] // 34 * 32)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)


def tensors(file_tensors: list[FileTensor], cfg: ModelConfig,
            native: bool) -> tuple[dict[str, torch.Tensor], dict[str, Packed]]:
    """Every tensor under its Hugging Face name, dequantized to fp32; and, when `native`, the
    ones in a format the kernel computes with as their blocks (weights.pack), rows in the same
    order — the ones the model will compute with as blocks (model.pack_plan) are then left
    unfilled in fp32 (the embedding table, whose rows a lookup reads, is always dequantized)."""
    permuted = cfg.arch in ("llama", "mistral")
    named, packed = [], {}
    for t in file_tensors:
        if t.name == "rope_freqs.weight":
            continue  # (in the config's RoPE: config)
        try:
            name = hf_name(t.name, cfg)
        except (KeyError, ValueError) as e:
            raise ValueError(f"GGUF tensor {t.name!r} has no place in a {cfg.arch} model") from e
        heads = {".self_attn.q_proj.": cfg.num_heads, ".self_attn.k_proj.": cfg.num_kv_heads}
        n = next((h for part, h in heads.items() if part in name), 0) if permuted else 0
        reorder = partial(_unpermute, n_head=n) if n else _as_is
        named.append((name, t, reorder))
        if native and (p := pack(t.data, t.tensor_type.name, reorder)) is not None:
            packed[name] = p
    blocks_only = {n for names in pack_plan(packed, cfg.num_layers).values() for n in names}
    out = {}
    for name, t, reorder in progress(named, "loading weights", unit="tensor"):
        if name in blocks_only:
            out[name] = torch.empty(packed[name].shape)
            continue
        w = reorder(_dequantize(t))
        if cfg.norm_plus_one and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's norm weights as 1 + w
        out[name] = torch.from_numpy(np.require(w, requirements=["C", "W"]))
    return out, packed
