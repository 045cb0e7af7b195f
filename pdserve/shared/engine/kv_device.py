"""Device-direct KV on one host: the decode worker reads the prefill worker's pool where it is.

The host path (a device→host copy, encoding and xxh3 on the host, a segment or a transport, a
host→device copy) moves every byte through host memory several times. Between two workers on one
host whose pools are on CUDA devices, the decode worker instead maps the prefill worker's whole
pool once and copies the blocks a notice names straight into its own, device to device:

- **Sharing.** The prefill worker shares its pool's allocation once (`share`: torch's
  `_share_cuda_`, a CUDA IPC handle) and names it in each device notice (`DeviceRef.pool`, a
  `PoolHandle` encoded) with the blocks to read (its own block ids). The pool lives as long as the
  worker, so the handle stays good; a notice's blocks are the handoff's until its ack, as on the
  host path.
- **Reading.** The decode worker opens a handle once per prefill worker (`Pools`: torch's
  `rebuild_cuda_tensor`, cudaIpcOpenMemHandle), gathers the notice's blocks of its layers into a
  buffer on the device (`read`), sums each block there (`block_sums`), and writes the verified ones
  into its pool (pdserve/shared/kv/receiver.py); a block whose sum differs is asked for again and
  comes over the host path.
- **Sums on the device**, not xxh3 (no device kernel): each block's 16-bit words times fixed
  pseudo-random weights, summed in int64 with no overflow (the weights are bounded by the block's
  size). A changed word always changes the sum; the sum is exact and the same on every device.
- **The CPU stand-in.** On CPU the same code runs with a pool moved into shared memory (torch's
  `_share_fd_cpu_`; another process opens it through /proc/<pid>/fd) in place of the IPC handle: the tests use it to run
  the block mapping, the sums and the refusal of a bad one. The CUDA branch runs only on a GPU
  (`scripts/gpu_check.py`, its `kv_device` step, hands a pool between two processes).

A CUDA IPC mapping is writable: a decode worker could write the prefill worker's pool. It is opened
only for the prefill worker a handoff was placed with, on the same host and user (`host_identity`),
and only read.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger("kv.device")
MAX_SUM = 1 << 62  # |a block's sum| stays below this (int64: no overflow)


@dataclass(frozen=True)
class PoolHandle:
    """What opens a shared pool in another process: its kind ("cuda", or "cpu" for the stand-in),
    its shape and dtype, and torch's sharing fields (bytes as hex)."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    fields: tuple[int | str | bool | None, ...]

    def encode(self) -> str:
        return json.dumps([self.kind, list(self.shape), self.dtype, list(self.fields)], separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> PoolHandle:
        kind, shape, dtype, fields = json.loads(text)
        if kind not in ("cuda", "cpu") or not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"not a pool handle: {text[:80]!r}")
        return cls(kind, tuple(int(s) for s in shape), dtype, tuple(fields))


def _wire(value: object) -> int | str | bool | None:
    """One of torch's sharing fields as JSON holds it (bytes as hex)."""
    if isinstance(value, bytes):
        return value.hex()
    if value is None or isinstance(value, int | str):
        return value
    raise TypeError(f"a sharing field of type {type(value).__name__}")


def share(pool: torch.Tensor) -> PoolHandle:
    """Share `pool` (contiguous, the whole allocation) with other processes of this host. On CPU
    this moves it into shared memory in place (every view of it follows)."""
    if not pool.is_contiguous() or pool.storage_offset():
        raise ValueError("only a whole, contiguous pool is shared")
    storage = pool.untyped_storage()
    fields: tuple[object, ...]
    if pool.device.type == "cuda":
        fields = storage._share_cuda_()   # (device, handle, size, offset, ref counter handle, its offset, event...)
    elif pool.device.type == "cpu":
        fields = (os.getpid(), *storage._share_fd_cpu_())   # (this process, the memory's file descriptor, size)
    else:
        raise ValueError(f"no device-direct KV from a {pool.device.type} pool")
    return PoolHandle(pool.device.type, tuple(pool.shape), str(pool.dtype).removeprefix("torch."),
                      tuple(_wire(f) for f in fields))


def share_on_device(pool: torch.Tensor) -> PoolHandle | None:
    """`share(pool)` where it is on a CUDA device (a CPU pool takes the segment); None where it cannot be shared."""
    if pool.device.type != "cuda":
        return None
    try:
        return share(pool)
    except RuntimeError as e:
        log.warning("the KV pool cannot be shared (%s): same-host KV takes the host path", e)
        return None


def open_pool(handle: PoolHandle) -> torch.Tensor:
    """The pool `handle` names, mapped into this process (no copy)."""
    dtype: torch.dtype = getattr(torch, handle.dtype)
    raw = [bytes.fromhex(f) if isinstance(f, str) else f for f in handle.fields]
    stride = torch.empty(handle.shape, device="meta").stride()
    if handle.kind == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        device, ipc, size, offset, counter, counter_offset, event, event_sync = raw
        # (the arguments torch.multiprocessing's own reduce_tensor passes it)
        return rebuild_cuda_tensor(torch.Tensor, handle.shape, stride, 0, torch.storage.TypedStorage, dtype, device,
                                   ipc, size, offset, False, counter, counter_offset, event, event_sync)
    pid, fd, size = (int(f or 0) for f in handle.fields)
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)   # (OSError: the owner is gone)
    try:
        storage = torch.UntypedStorage._new_shared_fd_cpu(own, size)  # type: ignore[attr-defined]  # (a dup of `own`)
    finally:
        os.close(own)
    return torch.empty(0, dtype=dtype).set_(storage, 0, handle.shape, stride)


def _weights(numel: int, device: torch.device) -> torch.Tensor:
    """The sums' weights for blocks of `numel` 16-bit words: odd, below MAX_SUM / (2^15 numel), a fixed
    integer hash of the position (the same in every process and torch version)."""
    limit = max(2, min(1 << 31, MAX_SUM // ((1 << 15) * max(numel, 1))))
    x = (torch.arange(numel, dtype=torch.int64) * 0x7FEB352D + 0x165667B1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF   # (both factors below 2^32 and 2^31: no overflow)
    x ^= x >> 12
    return ((x % (limit // 2)) * 2 + 1).to(device)


_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def block_sums(blocks: torch.Tensor, chunk_bytes: int = 64 << 20) -> list[int]:
    """One int64 sum per block of `blocks` (n, ...), computed where they are (one sync for the n values)."""
    n = blocks.shape[0]
    if n == 0:
        return []
    words = blocks.contiguous().reshape(n, -1).view(torch.uint8).view(n, -1)
    if words.shape[1] % 2:
        words = torch.nn.functional.pad(words, (0, 1))
    words = words.view(torch.int16)
    key = (words.shape[1], str(words.device))
    if (weights := _WEIGHTS.get(key)) is None:
        weights = _WEIGHTS[key] = _weights(words.shape[1], words.device)
    step = max(1, chunk_bytes // (8 * words.shape[1]))   # (int64 products: 4x the block's bytes)
    sums = [(words[i:i + step].to(torch.int64) * weights).sum(dim=1) for i in range(0, n, step)]
    return torch.cat(sums).tolist()


def read(pool: torch.Tensor, layer: int, num_layers: int, block_ids: list[int], block_shape: tuple[int, ...],
         dtype: torch.dtype) -> torch.Tensor:
    """Blocks `block_ids` of layers [layer, layer + num_layers) of a mapped pool, gathered into a
    buffer of this process on the pool's device: (num_layers * len(block_ids), *block_shape),
    layer-major. ValueError: the pool is not laid out as `block_shape`/`dtype`, or the range is outside it."""
    if tuple(pool.shape[2:]) != tuple(block_shape) or pool.dtype != dtype:
        raise ValueError(f"the sender's pool is {tuple(pool.shape[2:])} {pool.dtype}, not {block_shape} {dtype}")
    if not block_ids or min(block_ids) < 0 or max(block_ids) >= pool.shape[1] \
            or layer < 0 or num_layers <= 0 or layer + num_layers > pool.shape[0]:
        raise ValueError(f"layers {layer}+{num_layers}, blocks {block_ids[:4]}...: outside the sender's pool")
    ids = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
    return pool[layer:layer + num_layers].index_select(1, ids).reshape(-1, *block_shape)


class Pools:
    """The decode worker's side: other processes' pools of kind `kind`, opened on first use, one per owner.
    A first open that fails turns the device path off (`kind` ""): this process cannot open others'
    pools (another container, no CUDA IPC), so later handoffs take the host path."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.open: dict[str, tuple[str, torch.Tensor]] = {}   # by owner: (its handle, encoded; the mapped pool)
        self._lock = threading.Lock()   # (reads run on threads)

    def pool(self, owner: str, encoded: str) -> torch.Tensor:
        """Prefill worker `owner`'s pool that `encoded` names (OSError: it cannot be opened)."""
        with self._lock:
            if (had := self.open.get(owner)) is not None and had[0] == encoded:
                return had[1]
            try:
                handle = PoolHandle.decode(encoded)
                if handle.kind != self.kind:
                    raise ValueError(f"a {handle.kind} pool, this worker reads {self.kind} ones")
                pool = open_pool(handle)
            except (ValueError, RuntimeError, TypeError, OSError) as e:
                if not self.open:
                    log.warning("%s's pool cannot be opened here (%s): device-direct KV is off", owner, e)
                    self.kind = ""
                raise OSError(f"{owner}'s pool cannot be opened here: {e}") from e
            self.open[owner] = encoded, pool   # (a restarted owner's former pool is let go)
            return pool
