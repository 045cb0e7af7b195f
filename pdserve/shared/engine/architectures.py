"""The architectures served, each as the few `ModelConfig` fields where it differs from Llama.

`model_config(hf)` takes a checkpoint's transformers config (`AutoConfig`: the model class's
own defaults filled in, `layer_types` and `rope_parameters` standardized) and returns the
engine's; a `model_type` outside `ARCHITECTURES`, or a setting the engine does not compute (a
RoPE scaling outside rope.SCALINGS, bidirectional attention), is refused by name.
"""

from __future__ import annotations

from typing import Any

from pdserve.shared.engine.config import ModelConfig
from pdserve.shared.engine.rope import Rope

# model_type -> what its layer changes (documented in the README's table, checked by
# tests/engine/test_architectures.py)
ARCHITECTURES: dict[str, str] = {
    "llama": "(Llama 1-3.x; RoPE default, linear, dynamic, llama3 or yarn; tied or untied embeddings)",
    "mistral": "Llama with a sliding window on every layer (where set)",
    "qwen2": "biases on q, k, v; sliding window on the layers from max_window_layers (where used)",
    "qwen3": "RMSNorm on each head's q and k",
    "phi3": "fused qkv and gate-up projections, partial rotary",
    "gemma2": "(1 + w) norms around both blocks, scaled embeddings, GeGLU, soft-capped scores and "
              "logits, sliding window on alternate layers",
    "gemma3_text": "Gemma 2's layer with q/k norms instead of soft-capping, 5 sliding-window layers to 1 "
                   "global, each kind with its own RoPE",
}


def model_config(hf: Any) -> ModelConfig:
    arch = hf.model_type
    if arch not in ARCHITECTURES:
        raise ValueError(f"model_type {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"{arch}: bidirectional attention is not supported (a decoder serves causal models)")
    if getattr(hf, "mlp_bias", False):
        raise ValueError(f"{arch}: mlp_bias is not supported")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    rope_hf = hf.rope_parameters or {}
    layer_types = list(getattr(hf, "layer_types", None) or [])
    if "full_attention" in rope_hf:  # one RoPE per kind of layer (Gemma 3)
        rope_hf, local_hf = rope_hf["full_attention"], rope_hf.get("sliding_attention")
    else:
        local_hf = None
    window = getattr(hf, "sliding_window", None) or 0
    if arch in ("mistral", "phi3"):  # one window for every layer, where the config sets one
        windows = (window,) * hf.num_hidden_layers if window else ()
    else:
        windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types) if window else ()
    gemma = arch.startswith("gemma")
    eos = hf.eos_token_id
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"{arch}: activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    return ModelConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers, num_heads=heads, num_kv_heads=getattr(hf, "num_key_value_heads", None)
        or heads, head_dim=head_dim, rope=Rope.of(rope_hf), rms_norm_eps=float(hf.rms_norm_eps),
        max_position=hf.max_position_embeddings, tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        bos_token_id=hf.bos_token_id,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        arch=arch,
        qkv_bias=arch == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        o_bias=arch != "qwen2" and bool(getattr(hf, "attention_bias", False)),
        qk_norm=arch in ("qwen3", "gemma3_text"),
        rotary_dim=int(head_dim * rope_hf.get("partial_rotary_factor", 1.0)),
        activation="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu",
        norm_plus_one=gemma, sandwich_norms=gemma, embed_scale=hf.hidden_size ** 0.5 if gemma else 1.0,
        query_scale=hf.query_pre_attn_scalar ** -0.5 if gemma else 0.0,
        attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
        windows=windows if any(windows) else (),
        local_rope=Rope.of(local_hf) if local_hf is not None and any(windows) else None)
