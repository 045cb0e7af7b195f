"""In-process KV transport for unit tests and warmup: peers are FakeTransport objects in one
process, messages are copied through per-tag queues."""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict

import numpy as np

from shared.kv.base import KVTransport, layer_tag

_peers: dict[str, "FakeTransport"] = {}
_ids = itertools.count()


class FakeTransport(KVTransport):
    name = "fake"

    def __init__(self) -> None:
        self._address = f"fake-{next(_ids)}"
        self._inbox: dict[int, asyncio.Queue] = defaultdict(asyncio.Queue)
        _peers[self._address] = self

    @property
    def address(self) -> str:
        return self._address

    async def send(self, peer: str, kv_tag: int, layers: list[np.ndarray]) -> int:
        target = _peers.get(peer)
        if target is None:
            raise ConnectionError(f"no fake peer {peer}")
        for i, payload in enumerate(layers):
            target._inbox[layer_tag(kv_tag, i)].put_nowait(np.array(payload, copy=True))
        return sum(p.nbytes for p in layers)

    async def recv(self, kv_tag: int, out: np.ndarray) -> None:
        data = await self._inbox[kv_tag].get()
        out[:] = data.reshape(-1).view(np.uint8)
        self._inbox.pop(kv_tag, None)

    async def close(self) -> None:
        _peers.pop(self._address, None)
