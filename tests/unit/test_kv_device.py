"""Device-direct KV's pieces (pdserve/shared/engine/kv_device.py) on CPU: the sums computed where the blocks
are, the block mapping, and a pool shared with another process through the CPU stand-in of a CUDA IPC handle
(the pool in shared memory). The CUDA branch runs only on a GPU: scripts/gpu_check.py's kv_device step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.shared.engine import kv_device

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (2, 4, 2, 8)   # (k/v, block_size, kv_heads, head_dim)


def test_a_changed_word_changes_its_blocks_sum_and_no_other():
    blocks = torch.randn(6, *SHAPE, generator=torch.Generator().manual_seed(1))
    sums = kv_device.block_sums(blocks)
    assert sums == kv_device.block_sums(blocks.clone()) and len(set(sums)) == 6
    words = blocks[0].numel() * 2
    for i, word in [(0, 0), (3, words // 2), (5, words - 1)]:   # (the first, a middle and the last 16-bit word)
        changed = blocks.clone()
        changed[i].view(-1).view(torch.int16)[word] ^= 1
        assert [a != b for a, b in zip(kv_device.block_sums(changed), sums)] == [j == i for j in range(6)]


def test_the_sums_are_exact_whatever_the_chunks_or_the_dtype_of_the_same_bytes():
    blocks = torch.randn(9, *SHAPE, generator=torch.Generator().manual_seed(2))
    sums = kv_device.block_sums(blocks)
    assert kv_device.block_sums(blocks, chunk_bytes=1) == sums
    assert kv_device.block_sums(blocks.view(torch.int32)) == sums
    extreme = torch.full((2, 1 << 16), -32768, dtype=torch.int16)   # the largest words, the most of them
    weights = kv_device._weights(1 << 16, torch.device("cpu"))
    assert kv_device.block_sums(extreme) == [-32768 * int(weights.sum())] * 2   # (no overflow: exact)


def test_reading_gathers_the_named_blocks_layer_by_layer_and_refuses_another_layout():
    pool = torch.randn(3, 5, *SHAPE)
    rows = kv_device.read(pool, 1, 2, [4, 0], SHAPE, torch.float32)
    assert torch.equal(rows, torch.stack([pool[1, 4], pool[1, 0], pool[2, 4], pool[2, 0]]))
    for layer, count, ids, shape, dtype in [(0, 1, [5], SHAPE, torch.float32), (2, 2, [0], SHAPE, torch.float32),
                                            (0, 1, [-1], SHAPE, torch.float32), (0, 1, [], SHAPE, torch.float32),
                                            (0, 1, [0], (2, 4, 2, 4), torch.float32), (0, 1, [0], SHAPE, torch.half)]:
        with pytest.raises(ValueError):
            kv_device.read(pool, layer, count, ids, shape, dtype)


def test_a_pool_shared_on_cpu_is_read_in_place_by_another_process():
    pool = torch.randn(3, 10, *SHAPE)
    before, layer = pool.clone(), pool[1]   # (a view taken before: it follows the pool into shared memory)
    handle = kv_device.share(pool)
    assert torch.equal(pool, before) and kv_device.PoolHandle.decode(handle.encode()) == handle
    layer.fill_(0.5)   # after sharing: what the other process reads
    code = ("import json, sys, torch; from pdserve.shared.engine import kv_device as d; "
            "pool = d.open_pool(d.PoolHandle.decode(sys.argv[1])); "
            "print(json.dumps(d.block_sums(d.read(pool, 0, 3, [7, 2], tuple(pool.shape[2:]), pool.dtype))))")
    proc = subprocess.run([sys.executable, "-c", code, handle.encode()], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == kv_device.block_sums(kv_device.read(pool, 0, 3, [7, 2], SHAPE, torch.float32))
    assert json.loads(proc.stdout)[2:4] == kv_device.block_sums(torch.full((2, *SHAPE), 0.5))


def test_a_pool_that_cannot_be_opened_turns_the_device_path_off():
    pools = kv_device.Pools("cpu")
    with pytest.raises(OSError, match="cannot be opened"):
        pools.pool("p", kv_device.PoolHandle("cuda", (1, 1, *SHAPE), "float32", ()).encode())
    assert pools.kind == ""   # (this process reads no pool of another: later handoffs take the host path)
    with pytest.raises(OSError):
        kv_device.Pools("cpu").pool("p", "not a handle")


def test_only_a_cuda_pool_is_shared_by_a_worker():
    assert kv_device.share_on_device(torch.zeros(1, 2, *SHAPE)) is None   # (a CPU pool takes the segment)
