"""The file's own 4-bit blocks computed with as they are (pdserve/shared/engine/weights.py): the same
products as the dequantized matrices, to the kernel's 8-bit rounding of its input."""

from __future__ import annotations

import gguf
import helpers
import numpy as np
import pytest
import torch

from pdserve.shared.engine.gguf_file import _unpermute
from pdserve.shared.engine.kernels import blocks, cc
from pdserve.shared.engine.loader import LoadedModel, load
from pdserve.shared.engine.weights import Packed, choose, pack

RNG = np.random.default_rng(0)
FORMATS = list(blocks.BLOCKS)
def random_blocks(kind: str, rows: int, cols: int) -> np.ndarray:
    return helpers.random_blocks(kind, rows, cols, RNG)


def dequantized(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)))


@pytest.mark.parametrize("kind", FORMATS)
def test_packed_blocks_multiply_as_their_dequantized_matrix(kind):
    raw = random_blocks(kind, 96, 512)
    dense, packed = dequantized(raw, kind), pack(raw, kind)
    assert packed is not None and packed.shape == (96, 512)
    torch.manual_seed(0)  # (the error is ~0.5% typically; random rows reach 1% about once in 300)
    for rows in (1, 3, 4, 9):  # tiles of 4 rows of x in the kernel, and what is left
        x = torch.randn(rows, 512)
        want = x @ dense.t()
        err = (packed.matmul(x) - want).norm() / want.norm()
        assert err < 0.01  # 8-bit inputs: ~0.5%
    assert packed.matmul(torch.zeros(2, 512)).abs().max() == 0
    per, size = blocks.BLOCKS[kind]
    assert packed.nbytes == 96 * 512 // per * size


def test_rows_reordered_and_stacked_as_the_model_fuses_them():
    """q/k rows are un-permuted for rotate-half RoPE and q, k, v stacked into one projection, in
    whatever formats the file has them (a Q4_K_M file mixes them): the packed form follows."""
    q_raw, k_raw, v_raw = random_blocks("Q4_K", 64, 256), random_blocks("Q4_K", 32, 256), random_blocks("Q6_K", 32, 256)
    reorder = lambda w: _unpermute(w, 4)  # noqa: E731
    dense = torch.cat([torch.from_numpy(reorder(dequantized(q_raw, "Q4_K").numpy())), dequantized(k_raw, "Q4_K"),
                       dequantized(v_raw, "Q6_K")])
    qkv = Packed.cat([pack(q_raw, "Q4_K", reorder), pack(k_raw, "Q4_K"), pack(v_raw, "Q6_K")])
    assert qkv.formats == ("Q4_K", "Q6_K") and qkv.shape == (128, 256)
    for rows in (1, 3):
        x = torch.randn(rows, 256)
        want = x @ dense.t()
        assert (qkv.matmul(x) - want).norm() < 0.01 * want.norm()
    with pytest.raises(ValueError, match="at most 3 formats"):
        Packed.cat([pack(random_blocks(k, 32, 256), k) for k in ("Q4_K", "Q6_K", "Q5_K", "Q8_0")])
    with pytest.raises(RuntimeError, match="whole blocks"):
        pack(random_blocks("Q8_0", 8, 96), "Q8_0").matmul(torch.randn(1, 100))


def test_formats_other_than_the_blocks_stay_fp32():
    assert pack(np.zeros((4, 16), dtype=np.float32), "F32") is None


def test_the_weights_format_is_in_the_kv_fingerprint_unless_any_is_allowed():
    tiny = load("tiny")
    native = LoadedModel(tiny.model, tiny.config, None, tiny.name, tiny.weights_id, "native")
    fp = lambda m, any_format=False: m.fingerprint(torch.float32, 16, any_format)  # noqa: E731
    assert fp(tiny) != fp(native)
    assert fp(tiny, True) == fp(native, True) == fp(tiny)
    with pytest.raises(ValueError, match="unknown weights format"):
        load("tiny", weights="int3")


@pytest.mark.parametrize("kind", FORMATS)
def test_a_row_gets_the_same_product_to_the_bit_whatever_else_is_in_the_batch(kind):
    """Each row of x is summed alike alone and beside one or two others (the two-output-rows
    path) and in a batch of any size (tiles of 8 rows, the last padded): a sequence's logits do
    not depend on its batch."""
    packed = pack(random_blocks(kind, 64, 256), kind)
    assert packed is not None
    x, residual, norm = torch.randn(9, 256), torch.randn(9, 64), (torch.rand(256) + 0.5, 1e-5)
    batch = packed.matmul(x, residual, norm)
    for i in range(9):
        assert torch.equal(packed.matmul(x[i:i + 1], residual[i:i + 1], norm), batch[i:i + 1]), i
    for rows in (slice(2, 4), slice(2, 5), slice(2, 6)):
        assert torch.equal(packed.matmul(x[rows], residual[rows], norm), batch[rows]), rows
    assert packed.matmul(x[:0]).shape == (0, 64)  # a pass with no row to project (a prompt's middle chunk)


def test_the_kernel_does_the_layers_steps_before_and_after_the_product():
    """RMSNorm (Llama's or Gemma's), SwiGLU or GeGLU on the input and the residual add, in the
    kernel's one pass: the same as doing them in torch around the product."""
    raw = random_blocks("Q4_1", 48, 64)
    dense, packed = dequantized(raw, "Q4_1"), pack(raw, "Q4_1")
    x, residual, weight = torch.randn(6, 64), torch.randn(6, 48), torch.rand(64) + 0.5
    normed = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    cases = {"norm": (packed.matmul(x, norm=(weight, 1e-5)), normed @ dense.t()),
             "norm (1 + w)": (packed.matmul(x, norm=(weight, 1e-5), plus_one=True),
                              (normed / weight * (1 + weight)) @ dense.t()),
             "residual": (packed.matmul(x, residual=residual), residual + x @ dense.t())}
    gate_up = torch.randn(6, 128)
    gate, up = gate_up.chunk(2, dim=-1)
    cases["swiglu"] = (packed.matmul(gate_up, gate="silu"), (torch.nn.functional.silu(gate) * up) @ dense.t())
    gelu = torch.nn.functional.gelu(gate, approximate="tanh")
    cases["geglu"] = (packed.matmul(gate_up, gate="gelu_tanh"), (gelu * up) @ dense.t())
    for name, (got, want) in cases.items():
        assert (got - want).norm() < 0.01 * want.norm(), name
    with pytest.raises(ValueError, match="contiguous float32"):
        packed.matmul(x, residual=residual[:, :10])


def test_every_build_of_the_kernel_gives_the_same_products():
    """A CPU without AVX2 runs the kernel's plain-C loops, one without AVX-512 VNNI its AVX2 dot
    products: built both ways here, they give the vectorized build's products (the sums are
    integers; only the float rounding of the plain-C path may differ)."""
    builds = {"portable": cc.PORTABLE}
    if cc.has_feature("avx512_vnni"):
        builds["avx2"] = (*cc.FLAGS, "-mno-avx512f", "-mno-avx512vl", "-mno-avx512vnni")
    libs = {name: blocks.library(cc.build(blocks.SOURCE, flags, blocks.INCLUDES)) for name, flags in builds.items()}
    for kind in FORMATS:
        w = pack(random_blocks(kind, 40, 256), kind)
        assert w is not None
        for rows in (1, 5):  # one row: the vectorized build's two-output-rows path
            x, residual = torch.randn(rows, 256), torch.randn(rows, 40)
            norm = (torch.rand(256) + 0.5, 1e-5)
            want = blocks.matmul(w.descriptor, 40, x, residual, norm)
            for name, lib in libs.items():
                got = blocks.matmul(w.descriptor, 40, x, residual, norm, lib=lib)
                if name == "portable":
                    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (kind, rows, name)
                else:
                    assert torch.equal(got, want), (kind, rows, name)


def test_auto_computes_a_gguf_on_cpu_with_its_own_blocks_and_anything_else_in_fp32():
    assert choose("auto", True, "cpu", torch.float32) == "native"
    assert choose("auto", True, "cuda", torch.bfloat16) == "fp32"
    assert choose("auto", True, "cpu", torch.bfloat16) == "fp32"
    assert choose("auto", False, "cpu", torch.float32) == "fp32"  # a Hugging Face directory
    assert choose("fp32", True, "cpu", torch.float32) == "fp32"
    assert load("tiny", weights="auto").weights == "fp32"
