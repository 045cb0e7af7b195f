"""A pass's inputs in the buffers made once (step_buffers.py): the tensors a decode pass reads are the ones the
runner built before them, value for value; a graph bucket's padding rows write only the scratch block and leave
the real rows' logits as they are; the packed upload grows and keeps each list whole."""

from __future__ import annotations

import torch

from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.cuda_graphs import DecodeGraphs, buckets, wanted
from pdserve.shared.engine.kernels import select
from pdserve.shared.engine.step_buffers import StepBuffers

CPU = torch.device("cpu")


def test_a_decode_pass_reads_what_the_lists_say():
    buffers = StepBuffers(CPU, max_rows=8, max_width=6, scratch_block=-1, block_size=4)
    batch = buffers.decode([5, 6, 7], [3, 9, 0], [11, 37, 8], [[2], [4, 9, 1], [2]])
    assert batch is not None and buffers.holds(batch)
    assert batch.input_ids.tolist() == [5, 6, 7] and batch.positions.tolist() == [3, 9, 0]
    assert batch.slots.tolist() == [11, 37, 8] and batch.logits_index.tolist() == [0, 1, 2]
    assert batch.context_lens is not None and batch.context_lens.tolist() == [4, 10, 1]
    assert batch.block_tables is not None and batch.block_tables.tolist() == [[2, 0, 0], [4, 9, 1], [2, 0, 0]]
    assert batch.block_tables.is_contiguous() and batch.num_decode == 3
    assert buffers.decode([1] * 9, [0] * 9, [0] * 9, [[0]] * 9) is None  # more rows than the fixed places
    assert buffers.decode([1], [0], [0], [[0]], pad_to=4) is None  # no scratch block: no padding


def test_padding_rows_point_at_the_scratch_block():
    buffers = StepBuffers(CPU, max_rows=4, max_width=3, scratch_block=10, block_size=4)
    batch = buffers.decode([5, 6], [3, 5], [11, 21], [[2], [4, 5]], pad_to=4)
    assert batch is not None and batch.num_decode == 4
    assert batch.slots.tolist() == [11, 21, 40, 40] and batch.positions.tolist() == [3, 5, 0, 0]
    assert batch.context_lens is not None and batch.context_lens.tolist() == [4, 6, 1, 1]
    assert batch.block_tables is not None and batch.block_tables.tolist() == [[2, 0, 0], [4, 5, 0],
                                                                              [10, 0, 0], [10, 0, 0]]


def test_the_packed_upload_grows_and_keeps_each_list():
    buffers = StepBuffers(CPU, max_rows=2, max_width=2, scratch_block=-1, block_size=4)
    parts = [list(range(3000)), [], [7, 8], list(range(5000, 7000))]
    got = buffers.upload(parts)
    assert [t.tolist() for t in got] == parts and buffers.packed.host.numel() == 8192


def test_a_padded_pass_gives_the_real_rows_their_logits_and_writes_only_the_scratch_block(tiny):
    """What a graph replays, run eagerly here: the torch kernels, a pool one block larger (block 16)."""
    ops = select("torch", "cpu")
    pool = torch.randn(tiny.config.num_layers, 17, 2, 16, tiny.config.num_kv_heads, tiny.config.head_dim)
    buffers = StepBuffers(CPU, 8, 4, scratch_block=16, block_size=16)
    args = ([5, 9, 3], [20, 3, 40], [1 * 16 + 4, 2 * 16 + 3, 5 * 16 + 8], [[0, 1], [2], [4, 3, 5]])
    exact, padded = pool.clone(), pool.clone()
    want = tiny.model(buffers.decode(*args), exact, ops)
    got = tiny.model(buffers.decode(*args, pad_to=8), padded, ops)
    assert got.shape[0] == 8
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded[:, :16], exact[:, :16], rtol=1e-5, atol=1e-5)
    assert torch.equal(padded[:, 6:16], pool[:, 6:16])  # blocks no row writes: untouched
    assert not torch.equal(padded[:, 16], pool[:, 16]) and torch.equal(exact[:, 16], pool[:, 16])


def test_graphs_are_for_cuda_only_and_the_setting_reads_the_environment(monkeypatch):
    monkeypatch.delenv("PD_CUDA_GRAPHS", raising=False)
    assert not wanted(EngineConfig(num_blocks=4, cuda_graphs=True))  # on CPU: never
    assert wanted(EngineConfig(num_blocks=4, device="cuda"))
    assert not wanted(EngineConfig(num_blocks=4, device="cuda", cuda_graphs=False))
    monkeypatch.setenv("PD_CUDA_GRAPHS", "0")
    assert not wanted(EngineConfig(num_blocks=4, device="cuda"))
    assert wanted(EngineConfig(num_blocks=4, device="cuda", cuda_graphs=True))
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64] and buckets(3) == [1, 2, 3]


def test_a_backend_graphs_cannot_take_says_why_once(tiny, caplog):
    pool = torch.zeros(1, 5, 2, 16, 2, 16)
    buffers = StepBuffers(CPU, 4, 4, scratch_block=4, block_size=16)
    graphs = DecodeGraphs(tiny.model, select("torch", "cpu"), pool, buffers, tiny.config.vocab_size)
    assert graphs.off is not None and "reads every block" in graphs.off
    assert graphs.bucket(2, False, None) is None
    assert "CUDA graphs off" in caplog.text
