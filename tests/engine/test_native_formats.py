"""A model whose matrices mix every block format the kernel computes with (as a Q4_K_M file's
do: q, k and v of one projection in three formats), random weights: its native passes give
the dequantized model's logits to the kernel's 8-bit rounding of activations, and its decode
passes in one C call (kernels/fused.c) give the layer-by-layer path's, bit for bit."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from helpers import pass_logits, random_blocks

from pdserve.shared.engine.config import ModelConfig
from pdserve.shared.engine.loader import LoadedModel, _build
from pdserve.shared.engine.weights import pack

CFG = replace(ModelConfig.tiny(vocab_size=300), hidden_size=256, intermediate_size=512, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=64)
# each layer's matrices' formats (Hugging Face names): every format, three in one stacked qkv
FORMATS = [{"q_proj": "Q4_K", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q6_K", "gate_proj": "Q5_K",
            "up_proj": "Q4_0", "down_proj": "Q6_K"},
           {"q_proj": "Q5_1", "k_proj": "Q5_1", "v_proj": "Q6_K", "o_proj": "Q4_1", "gate_proj": "Q4_K",
            "up_proj": "Q4_K", "down_proj": "Q8_0"}]
SHAPES = {"q_proj": (256, 256), "k_proj": (128, 256), "v_proj": (128, 256), "o_proj": (256, 256),
          "gate_proj": (512, 256), "up_proj": (512, 256), "down_proj": (256, 512)}


@pytest.fixture(scope="module")
def models() -> tuple[LoadedModel, LoadedModel]:
    """(the model on native weights, the same model dequantized to fp32)."""
    rng = np.random.default_rng(7)
    raw = {}
    for i, formats in enumerate(FORMATS):
        for name, kind in formats.items():
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            raw[f"model.layers.{i}.{part}.{name}.weight"] = (kind, random_blocks(kind, *SHAPES[name], rng, 0.2))
    dense = {n: torch.from_numpy(gguf.quants.dequantize(r, getattr(gguf.GGMLQuantizationType, k)))
             for n, (k, r) in raw.items()}
    gen = torch.Generator().manual_seed(7)
    dense["model.embed_tokens.weight"] = torch.randn(CFG.vocab_size, CFG.hidden_size, generator=gen)
    dense["model.norm.weight"] = torch.ones(CFG.hidden_size)
    for i in range(CFG.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(CFG.hidden_size, generator=gen)
    built = []
    for native in (True, False):
        model = _build(CFG, [dense], torch.float32, "cpu")
        if native:
            model.pack({n: p for n, (k, r) in raw.items() if (p := pack(r, k)) is not None})
        built.append(LoadedModel(model, CFG, None, "mixed", "mixed-seed-7", "native" if native else "fp32"))
    return built[0], built[1]


PROMPTS = {"a": list(range(3, 40)), "b": list(range(100, 107)), "c": [5] * 60}


def test_every_matrix_is_computed_with_its_own_blocks(models):
    native, _ = models
    assert native.model.packed_formats() == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    qkv = native.model.layers[0].self_attn.qkv_proj.packed
    assert qkv is not None and qkv.formats == ("Q4_K", "Q5_0", "Q8_0")
    assert native.model.packed_layers is not None  # decode passes take the one call


def test_native_logits_are_the_dequantized_models_to_the_activations_rounding(models):
    """The prompts' pass (the same input to both; later passes follow each model's own tokens):
    a random model's near-flat logits move 2–9% under 8-bit activations, a matrix wired to the
    wrong rows moves them ~100%."""
    native, dense = models
    got, want = pass_logits(native, PROMPTS)[0], pass_logits(dense, PROMPTS)[0]
    assert got.keys() == want.keys() == PROMPTS.keys()
    for rid in got:
        err = (got[rid] - want[rid]).norm() / want[rid].norm()
        assert err < 0.15 and got[rid].argmax() == want[rid].argmax(), (rid, float(err))


def test_decode_in_one_call_equals_the_layer_by_layer_path_to_the_bit(models, monkeypatch):
    native, _ = models
    one_call = pass_logits(native, PROMPTS)
    monkeypatch.setattr(native.model, "fuse", False)
    layered = pass_logits(native, PROMPTS)
    assert len(one_call) == len(layered) >= 12
    for a, b in zip(one_call, layered):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
