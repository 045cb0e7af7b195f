"""Split-KV paged decode attention (kernels/triton_decode.py, interpreted on CPU) against torch's, at
the head layouts of Qwen2.5-1.5B, Llama-3.2-1B and a Gemma-3-shaped model; and the split count."""

from pathlib import Path

import pytest
import torch

from pdserve.shared.engine.kernels import select, torch_ref

triton_decode = pytest.importorskip("pdserve.shared.engine.kernels.triton_decode")

# name: (query heads, KV heads, head dim)
SHAPES = {"qwen2.5-1.5b": (12, 2, 128), "llama-3.2-1b": (32, 8, 64), "gemma-3": (4, 1, 256)}


def _inputs(shape, bs=16, lens=(37, 5, 20), dtype=torch.float32, seed=0):
    """q (B, H, hd), a pool of 12 blocks and each sequence's table: distinct shuffled blocks, the
    last one part-filled (lens not multiples of bs), the table padded with block 0."""
    h, kvh, hd = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(12, 2, bs, kvh, hd, generator=g).to(dtype)
    width = max(-(-n // bs) for n in lens)
    order = torch.randperm(12, generator=g).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    for b, n in enumerate(lens):
        used = -(-n // bs)
        tables[b, :used] = torch.tensor(order[:used])
        order = order[used:] + order[:used]
    q = torch.randn(len(lens), h, hd, generator=g).to(dtype)
    return q, pool, tables, torch.tensor(lens)


def _check(shape, splits, window=0, softcap=0.0, **kw):
    q, pool, tables, lens = _inputs(shape, **kw)
    scale = SHAPES[shape][2] ** -0.5
    out = triton_decode.paged_decode_attention(q, pool, tables, lens, scale, window, softcap, splits=splits)
    ref = torch_ref.paged_decode_attention(q.float(), pool.float(), tables, lens, scale, window, softcap)
    tol = 1e-5 if q.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shape", ["qwen2.5-1.5b", "llama-3.2-1b"])
def test_split_decode_matches_torch(shape, splits):
    """Three sequences of different lengths, none filling its last block, in one split and in three."""
    _check(shape, splits)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (9, 0.0), (24, 2.5)])
def test_split_decode_gemma_shape_with_window_and_softcap(window, softcap, splits):
    """One KV head for four query heads: windows shorter than some contexts and longer than others,
    scores soft-capped, in blocks of 8 tokens (a split starts mid-block)."""
    _check("gemma-3", splits, window, softcap, bs=8, lens=(29, 5, 17))


def test_more_splits_than_positions_and_bfloat16():
    """A 3-token sequence cut 6 ways (empty splits weigh nothing in the merge), in bfloat16."""
    _check("qwen2.5-1.5b", 6, lens=(3, 40), dtype=torch.bfloat16)


def test_the_unsplit_kernel_agrees():
    """The other Triton decode kernel (PD_KERNELS=triton-unsplit) on the same inputs."""
    from pdserve.shared.engine.kernels import triton_kernels

    q, pool, tables, lens = _inputs("llama-3.2-1b", lens=(33, 7))
    got = triton_decode.paged_decode_attention(q, pool, tables, lens, 0.125, splits=2)
    torch.testing.assert_close(got, triton_kernels.paged_decode_attention(q, pool, tables, lens, 0.125),
                               atol=1e-5, rtol=1e-5)


def test_split_count_fills_an_h100_at_batch_1():
    n = triton_decode.num_splits
    assert n(1, 2, 2048, 132) * 2 >= 132      # Qwen2.5-1.5B: 66 splits, 132 programs
    assert n(1, 8, 2048, 132) * 8 >= 132      # Llama-3.2-1B: 17
    assert n(32, 8, 2048, 132) == 1           # 256 programs without splitting
    assert n(8, 2, 2048, 132) == 9            # 16 programs a split
    assert n(1, 1, 100, 132) == 100 // triton_decode.MIN_SPLIT_TOKENS  # short contexts: fewer, longer splits
    assert n(1, 2, 5, 132) == 1


def test_the_setting_picks_the_kernel():
    assert select("triton", "cpu").paged_decode_attention is triton_decode.paged_decode_attention
    unsplit = select("triton-unsplit", "cpu")
    assert unsplit.name == "triton" and unsplit.paged_decode_attention is not triton_decode.paged_decode_attention


def test_the_device_checks_timing_step_runs_interpreted(monkeypatch):
    """scripts/gpu_attention.py (gpu_check's kernels step) at a tiny size: both kernels agree with torch's
    and are timed (eager only: no CUDA graph here)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    import gpu_attention

    failed = []
    result = gpu_attention.decode_attention("cpu", lambda name, ok, detail="": ok or failed.append(name),
                                            names=["qwen2.5-1.5b"], batches=(2,), context=40, reps=1)
    row = result["qwen2.5-1.5b"]["batch 2"]
    assert not failed and row["splits"] == 1 and row["split"]["eager_us"] > 0 and "graph_us" not in row["split"]
    assert gpu_attention.speedups(result)["qwen2.5-1.5b"]["batch 2"] > 0
