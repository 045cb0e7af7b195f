"""A GGUF file as the engine's: its architecture, its tensors under Hugging Face names, its tokenizer.

- `config`: the file's metadata for its architecture (llama.cpp's keys, renamed as transformers
  renames them: `GGUF_CONFIG_MAPPING`) given to that architecture's transformers config class,
  which fills in what a GGUF does not carry (Gemma 3's layer pattern, local RoPE base, query
  scale), then architectures.model_config as for a directory.
- `tensors`: every tensor dequantized (any format gguf-py reads: Q4_0…Q8_0, K-quants, F16, F32)
  under its Hugging Face name, undoing what llama.cpp's converter did: q/k rows interleaved
  for its RoPE (Llama and Mistral files), 1 added to Gemma's norm weights.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import cast

import numpy as np
import torch

from shared.engine.architectures import ARCHITECTURES, model_config
from shared.engine.config import ModelConfig
from shared.engine.weights import Packed, pack

# blk.N.<kind> -> the layer's Hugging Face module (Gemma's ffn_norm is its pre-feedforward norm)
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # GGUF architecture -> transformers model_type, where they differ


def metadata(path: Path) -> tuple[dict, tuple[str, ...]]:
    """The file's metadata (its arrays as their lengths) and tensor names, read without the
    tensors or the vocabulary (transformers' GGUF reader: well under a second where gguf-py's
    reader parses every vocabulary entry first)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    return read_gguf_metadata(str(path))


def model_type(meta: dict) -> str:
    arch = meta["general.architecture"]
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        return "mistral"  # llama.cpp writes Mistral as llama (transformers reads it back as mistral)
    return _MODEL_TYPES.get(arch, arch)


def config(path: Path) -> ModelConfig:
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    meta, names = metadata(path)
    arch, mtype = meta["general.architecture"], model_type(meta)
    if mtype not in ARCHITECTURES or arch not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: rope_freqs.weight (Llama 3.1's RoPE scaling as llama.cpp stores it) is not "
                         "supported in GGUF files yet: load the safetensors directory")
    renames = cast(dict[str, str | None], GGUF_CONFIG_MAPPING[arch])
    kwargs = {hf: meta[f"{arch}.{key}"] for key, hf in renames.items() if hf is not None and f"{arch}.{key}" in meta}
    kwargs.setdefault("vocab_size", meta["tokenizer.ggml.tokens"])  # (the vocabulary's length)
    for key in ("bos", "eos", "padding"):
        if (token := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            kwargs["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token)
    try:
        return model_config(AutoConfig.for_model(mtype, tie_word_embeddings="output.weight" not in names, **kwargs))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


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


def tensors(reader, cfg: ModelConfig, native: bool) -> tuple[dict[str, torch.Tensor], dict[str, Packed]]:
    """Every tensor under its Hugging Face name, dequantized to fp32; and, when `native`, the
    Q4_1 / Q8_0 ones also as their blocks (weights.pack), rows in the same order."""
    import gguf

    permuted = cfg.arch in ("llama", "mistral")
    out, packed = {}, {}
    for t in reader.tensors:
        try:
            name = hf_name(t.name, cfg)
        except (KeyError, ValueError) as e:
            raise ValueError(f"GGUF tensor {t.name!r} has no place in a {cfg.arch} model") from e
        heads = {".self_attn.q_proj.": cfg.num_heads, ".self_attn.k_proj.": cfg.num_kv_heads}
        n = next((h for part, h in heads.items() if part in name), 0) if permuted else 0
        reorder = partial(_unpermute, n_head=n) if n else _as_is
        w = reorder(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False))
        if cfg.norm_plus_one and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's norm weights as 1 + w
        out[name] = torch.from_numpy(np.require(w, requirements=["C", "W"]))
        if native and (p := pack(t.data, t.tensor_type.name, reorder)) is not None:
            packed[name] = p
    return out, packed
