"""Device-direct KV between two processes, part of `make gpu-check` (scripts/gpu_check.py): a pool of
Qwen2.5-1.5B's KV shape (28 layers, 2 KV heads of 128, bfloat16, blocks of 16 tokens) is shared by CUDA IPC
(pdserve/shared/engine/kv_device.py); a second process opens it, reads a 2k-token prompt's blocks (scattered
over the pool) of every layer in pieces of PD_KV_PIECE_BYTES, sums each block on its device and writes them
into a pool of its own, which it shares back. Checked: its pool equals the first's block for block, its sums
equal the sender's, and a byte changed in one block after the sender summed it is caught in that block alone.
Timed: the read (gather, sums, write) against the host path's passes over the same blocks in one process
(device→host into pinned memory, xxh3 per block, a copy into a segment, a copy out of it, xxh3 again,
host→device, scatter).

On CPU the same runs with tiny shapes and the CPU stand-in of the handle (a pool in shared memory).

    python3 scripts/gpu_kv_device.py --device cuda     prints the JSON gpu_check records as `kv_device`
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]  # (the image's python3 has no pdserve installed)

from pdserve.shared.engine import kv_device  # noqa: E402

PIECE_BYTES = 8 << 20   # PD_KV_PIECE_BYTES' default: consecutive layers gathered per message
@dataclass(frozen=True)
class Shape:
    layers: int
    pool_blocks: int
    blocks: int                        # the prompt's: 2k tokens on CUDA
    block_shape: tuple[int, ...]       # (k/v, block_size, kv_heads, head_dim)
    dtype: str


SHAPES = {"cuda": Shape(layers=28, pool_blocks=1024, blocks=128, block_shape=(2, 16, 2, 128), dtype="bfloat16"),
          "cpu": Shape(layers=4, pool_blocks=64, blocks=8, block_shape=(2, 4, 2, 8), dtype="float32")}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _pieces(layers: int, layer_bytes: int) -> list[tuple[int, int]]:
    """(first layer, layer count) of each message, as the sender batches them."""
    per = max(1, PIECE_BYTES // max(layer_bytes, 1))
    return [(first, min(per, layers - first)) for first in range(0, layers, per)]


def child() -> None:
    """The reading process: the spec on stdin, its figures and its pool's handle on stdout; it keeps its pool
    until stdin closes (the first process reads it meanwhile)."""
    spec = json.loads(sys.stdin.readline())
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    src = kv_device.open_pool(kv_device.PoolHandle.decode(spec["pool"]))
    open_ms = (time.perf_counter() - start) * 1e3
    shape, dtype = tuple(spec["block_shape"]), src.dtype
    dst = torch.zeros_like(src)
    dst_ids = torch.tensor(spec["dst_ids"], dtype=torch.long, device=device)

    def once() -> list[int]:
        sums = []
        for first, count in spec["pieces"]:
            rows = kv_device.read(src, first, count, spec["ids"], shape, dtype)
            sums += kv_device.block_sums(rows)
            dst[first:first + count].index_copy_(1, dst_ids, rows.view(count, len(spec["ids"]), *shape))
        return sums

    sums = once()
    _sync(device)
    read_ms = _median_ms(once, device, spec["reps"])
    bad = [i for i, (a, b) in enumerate(zip(sums, spec["sums"])) if a != b]
    print(json.dumps({"open_ms": open_ms, "read_ms": read_ms, "bad": bad, "pool": kv_device.share(dst).encode()}),
          flush=True)
    sys.stdin.read()


def host_path_ms(pool: torch.Tensor, ids: torch.Tensor, dst_ids: torch.Tensor, pieces: list[tuple[int, int]],
                 reps: int) -> tuple[float, str]:
    """The host path's passes over the same blocks, in one process; and the checksum it used."""
    digest: Callable[[memoryview], int]
    try:
        import xxhash

        digest, name = xxhash.xxh3_64_intdigest, "xxh3"
    except ImportError:   # (the image may lack it: crc32 stands in, slower)
        digest, name = zlib.crc32, "crc32 (no xxhash here)"
    cuda, n = pool.device.type == "cuda", len(ids)
    dst = torch.zeros_like(pool)
    width = pool[0, 0].nbytes
    most = max(count for _, count in pieces) * n
    segment, staged = np.empty((most, width), np.uint8), np.empty((most, width), np.uint8)

    def once() -> None:
        for first, count in pieces:
            rows = pool[first:first + count].index_select(1, ids)
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=cuda)
            host.copy_(rows, non_blocking=cuda)
            _sync(pool.device)
            raw = host.view(-1).view(torch.uint8).numpy().reshape(count * n, width)
            sent = [digest(row.data) for row in raw]
            np.copyto(segment[:count * n], raw)
            np.copyto(staged[:count * n], segment[:count * n])
            got = [digest(row.data) for row in staged[:count * n]]
            assert got == sent
            back = torch.from_numpy(staged[:count * n]).view(pool.dtype).reshape(count, n, *pool.shape[2:])
            dst[first:first + count].index_copy_(1, dst_ids, back.to(pool.device, non_blocking=cuda))

    once()
    return _median_ms(once, pool.device, reps), name


def run(device_name: str, check: Callable[[str, bool, str], None], reps: int = 5) -> dict:
    device = torch.device(device_name)
    s = SHAPES[device.type]
    dtype, shape = getattr(torch, s.dtype), s.block_shape
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(s.layers, s.pool_blocks, *shape, device=device,
                       generator=torch.Generator(device).manual_seed(0)).to(dtype)
    ids = torch.randperm(s.pool_blocks, generator=g)[:s.blocks].to(device)
    dst_ids = torch.randperm(s.pool_blocks, generator=g)[:s.blocks].to(device)
    pieces = _pieces(s.layers, pool[0, 0].nbytes * len(ids))
    handle = kv_device.share(pool)
    sums: list[int] = []
    sender_ms = _median_ms(lambda: [kv_device.block_sums(pool[f:f + c].index_select(1, ids).reshape(-1, *shape))
                                    for f, c in pieces], device, reps)
    for first, count in pieces:
        sums += kv_device.block_sums(pool[first:first + count].index_select(1, ids).reshape(-1, *shape))
    changed = len(ids) // 2   # block `changed` of layer 0: one 16-bit word differs from what the sender summed
    pool[0, int(ids[changed])].view(-1).view(torch.int16)[3] += 1
    spec = {"pool": handle.encode(), "device": str(device), "ids": ids.tolist(), "dst_ids": dst_ids.tolist(),
            "sums": sums, "pieces": pieces, "block_shape": list(shape), "reps": reps}
    proc = subprocess.Popen([sys.executable, __file__, "--child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(spec) + "\n")
        proc.stdin.flush()
        got = json.loads(next(line for line in proc.stdout if line.startswith("{")))
        theirs = kv_device.open_pool(kv_device.PoolHandle.decode(got["pool"]))
        equal = torch.equal(theirs[:, dst_ids], pool[:, ids])
        del theirs
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=60)
    host_ms, digest = host_path_ms(pool, ids, dst_ids, pieces, reps)
    nbytes = pool[0, 0].nbytes * len(ids) * s.layers
    check("kv device: the blocks read from another process's pool equal it", equal, f"{nbytes / 1e6:.1f} MB")
    check("kv device: a word changed after the sender summed its block is caught there alone", got["bad"] == [changed],
          f"blocks refused: {got['bad']}")
    return {"kind": handle.kind, "layers": s.layers, "blocks": len(ids), "bytes": nbytes, "pieces": len(pieces),
            "equal": equal, "refused_blocks": got["bad"], "open_ms": round(got["open_ms"], 2),
            "device_read_ms": round(got["read_ms"], 3), "sender_sums_ms": round(sender_ms, 3),
            "host_path_ms": round(host_ms, 3), "host_checksum": digest,
            "host_over_device": round(host_ms / max(got["read_ms"] + sender_ms, 1e-9), 2)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child()
    else:
        print(json.dumps(run(args.device, lambda name, ok, detail: print("PASS" if ok else "FAIL", name, detail)),
                         indent=2))
