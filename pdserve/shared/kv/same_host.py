"""The same-host paths as a KV transport: `SameHost` puts this process's segment (a prefill
worker's, pdserve/shared/kv/segment.py `Segment`) or its mappings of other processes' segments (a decode
worker's, `Segments`) in front of a transport between hosts. A payload for a peer on this host
is written into a region of the segment (`place`) and read out of it (`read`); every other
payload goes through the inner transport on its tag. Where both pools are on a device, a
prefill worker's shared pool (`pool`) and a decode worker's mappings of them (`pools`) carry the
streamed KV instead, device to device (pdserve/shared/engine/kv_device.py: `pool_handle`, `read_device`).
The KVLayer notice says which (`segment`, `device`).
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from pdserve.shared.engine import kv_device
from pdserve.shared.kv.base import KVTransport
from pdserve.shared.kv.segment import Segment, Segments, host_identity
from pdserve.shared.messages import DeviceRef, SegmentRef

INLINE_COPY = 1 << 20  # larger copies out of a segment (and a first mapping) run off the event loop


class SameHost(KVTransport):
    def __init__(self, inner: KVTransport, segment: Segment | None = None, segments: Segments | None = None,
                 pool: kv_device.PoolHandle | None = None, pools: kv_device.Pools | None = None):
        super().__init__(inner.faults)
        self.inner, self.segment, self.segments = inner, segment, segments
        self.pool, self.pools = pool, pools
        self._pool_handle = pool.encode() if pool is not None else ""
        self.name = inner.name

    @classmethod
    def reader(cls, inner: KVTransport, scope: str, device: torch.device) -> SameHost:
        """A decode worker's: other processes' segments (of deployment `scope`), and their pools where
        this worker's pool is on `device` of kind CUDA (pdserve/shared/engine/kv_device.py)."""
        return cls(inner, segments=Segments(scope), pools=kv_device.Pools("cuda") if device.type == "cuda" else None)

    @property
    def address(self) -> str:
        return self.inner.address

    @property
    def host(self) -> str:
        if self.segment is not None:
            return self.segment.host
        if self.segments is not None:
            return self.segments.host
        return host_identity() if self.device else ""

    @property
    def device(self) -> str:
        if self.pool is not None:
            return self.pool.kind
        return self.pools.kind if self.pools is not None else ""

    @property
    def pool_handle(self) -> str:
        return self._pool_handle

    def read_device(self, owner: str, ref: DeviceRef, layers: tuple[int, int], block_shape: tuple[int, ...],
                    dtype: torch.dtype) -> torch.Tensor:
        if self.pools is None:
            raise OSError("this process reads no pool")
        return kv_device.read(self.pools.pool(owner, ref.pool), *layers, ref.block_ids, block_shape, dtype)

    def place(self, peer_host: str, nbytes: int) -> tuple[SegmentRef, np.ndarray] | None:
        if self.segment is None or not peer_host or peer_host != self.segment.host:
            return None
        return self.segment.take(nbytes)

    def release(self, ref: SegmentRef) -> None:
        if self.segment is not None:
            self.segment.give(ref)

    async def read(self, owner: str, ref: SegmentRef, out: np.ndarray) -> None:
        if self.segments is None:
            raise OSError("this process reads no segment")
        if out.nbytes <= INLINE_COPY and self.segments.mapped(owner, ref):
            self.segments.read(owner, ref, out)   # (the placed prefill worker's: no other)
        else:
            await asyncio.to_thread(self.segments.read, owner, ref, out)

    async def _send(self, peer: str, tag: int, payload: np.ndarray) -> None:
        await self.inner._send(peer, tag, payload)

    async def recv(self, tag: int, out: np.ndarray) -> None:
        await self.inner.recv(tag, out)

    def has_endpoint(self, peer: str) -> bool:
        return self.inner.has_endpoint(peer)

    async def forget(self, peer: str) -> None:
        await self.inner.forget(peer)

    async def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
        await self.inner.close()

