"""The file's own 4-bit blocks computed with as they are (shared/engine/weights.py): the same
products as the dequantized matrices, to the kernel's 8-bit rounding of its input."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from shared.engine.gguf_file import _unpermute
from shared.engine.loader import LoadedModel, load
from shared.engine.weights import Packed, pack

RNG = np.random.default_rng(0)


def q4_1_blocks(rows: int, cols: int) -> np.ndarray:
    """Random Q4_1 rows: per 32 weights fp16 d, fp16 m, then 16 bytes of two nibbles."""
    blocks = np.zeros((rows, cols // 32, 20), dtype=np.uint8)
    blocks[..., 0:2] = (RNG.random((rows, cols // 32, 1)) * 0.1).astype(np.float16).view(np.uint8)
    blocks[..., 2:4] = (-RNG.random((rows, cols // 32, 1)) * 0.5).astype(np.float16).view(np.uint8)
    blocks[..., 4:] = RNG.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def q8_0_blocks(rows: int, cols: int) -> np.ndarray:
    """Random Q8_0 rows: per 32 weights fp16 d, then 32 int8 (the extremes included)."""
    blocks = np.zeros((rows, cols // 32, 34), dtype=np.uint8)
    blocks[..., 0:2] = (RNG.random((rows, cols // 32, 1)) * 0.05).astype(np.float16).view(np.uint8)
    q = RNG.integers(-128, 128, (rows, cols // 32, 32), dtype=np.int8)
    q[0, 0, :2] = (-128, 127)
    blocks[..., 2:] = q.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind, make", [("Q4_1", q4_1_blocks), ("Q8_0", q8_0_blocks)])
def test_packed_blocks_multiply_as_their_dequantized_matrix(kind, make):
    raw = make(96, 128)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)))
    packed = pack(raw, kind)
    assert packed is not None and packed.shape == (96, 128)
    torch.manual_seed(0)  # (the error is ~0.5% typically; random rows reach 1% about once in 300)
    for rows in (1, 3, 4, 9):  # tiles of 4 rows of x in the kernel, and what is left
        x = torch.randn(rows, 128)
        want = x @ dense.t()
        err = (packed.matmul(x) - want).norm() / want.norm()
        assert err < 0.01  # 8-bit inputs: ~0.5%
    assert packed.matmul(torch.zeros(2, 128)).abs().max() == 0
    assert packed.nbytes <= dense.nbytes * {"Q4_1": 0.75, "Q8_0": 1.125}[kind] / 4  # bytes a weight


def test_rows_reordered_and_stacked_as_the_model_fuses_them():
    """q/k rows are un-permuted for rotate-half RoPE and q, k, v stacked into one projection:
    the packed form follows both."""
    q_raw, v_raw = q4_1_blocks(64, 64), q4_1_blocks(32, 64)
    reorder = lambda w: _unpermute(w, 4)  # noqa: E731
    dense = torch.cat([torch.from_numpy(reorder(gguf.quants.dequantize(q_raw, gguf.GGMLQuantizationType.Q4_1))),
                       torch.from_numpy(gguf.quants.dequantize(v_raw, gguf.GGMLQuantizationType.Q4_1))])
    both = Packed.cat([pack(q_raw, "Q4_1", reorder), pack(v_raw, "Q4_1")])
    x = torch.randn(3, 64)
    want = x @ dense.t()
    assert (both.matmul(x) - want).norm() < 0.01 * want.norm()
    with pytest.raises(ValueError, match="same format"):
        Packed.cat([pack(q_raw, "Q4_1"), pack(q8_0_blocks(32, 64), "Q8_0")])


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


@pytest.mark.parametrize("kind, make", [("Q4_1", q4_1_blocks), ("Q8_0", q8_0_blocks)])
def test_a_row_gets_the_same_product_to_the_bit_whatever_else_is_in_the_batch(kind, make):
    """Each row of x is summed alike alone (the two-output-rows path) and in a batch of any size
    (tiles of 4 rows, and what is left): a sequence's logits do not depend on its batch."""
    packed = pack(make(64, 128), kind)
    assert packed is not None
    x, residual, norm = torch.randn(9, 128), torch.randn(9, 64), (torch.rand(128) + 0.5, 1e-5)
    batch = packed.matmul(x, residual, norm)
    for i in range(9):
        assert torch.equal(packed.matmul(x[i:i + 1], residual[i:i + 1], norm), batch[i:i + 1]), i
    assert torch.equal(packed.matmul(x[2:5], residual[2:5], norm), batch[2:5])


def test_the_kernel_does_the_layers_steps_before_and_after_the_product():
    """RMSNorm or SwiGLU on the input and the residual add, in the kernel's one pass: the same as
    doing them in torch around the product."""
    raw = q4_1_blocks(48, 64)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1))
    packed = pack(raw, "Q4_1")
    x, residual, weight = torch.randn(6, 64), torch.randn(6, 48), torch.rand(64) + 0.5
    normed = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    cases = {"norm": (packed.matmul(x, norm=(weight, 1e-5)), normed @ dense.t()),
             "residual": (packed.matmul(x, residual=residual), residual + x @ dense.t())}
    gate_up = torch.randn(6, 128)
    gate, up = gate_up.chunk(2, dim=-1)
    cases["swiglu"] = (packed.matmul(gate_up, swiglu=True), (torch.nn.functional.silu(gate) * up) @ dense.t())
    for name, (got, want) in cases.items():
        assert (got - want).norm() < 0.01 * want.norm(), name
    with pytest.raises(ValueError, match="contiguous float32"):
        packed.matmul(x, residual=residual[:, :10])


def test_the_kernels_plain_c_path_gives_its_avx2_paths_products():
    """A CPU without AVX2 runs the kernel's plain-C loops: built without AVX2 here, they give the
    same products (to float rounding) as the vectorized build."""
    from shared.engine.kernels import blocks, cc

    portable = blocks.library(cc.build(blocks.SOURCE, cc.PORTABLE))
    for kind, make in (("Q4_1", q4_1_blocks), ("Q8_0", q8_0_blocks)):
        w = pack(make(40, 96), kind)
        assert w is not None
        for rows in (1, 5):  # one row: the vectorized build's two-output-rows path
            x, residual = torch.randn(rows, 96), torch.randn(rows, 40)
            norm = (torch.rand(96) + 0.5, 1e-5)
            want = blocks.matmul(kind, x, w.raw, residual, norm)
            got = blocks.matmul(kind, x, w.raw, residual, norm, lib=portable)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (kind, rows)
