"""In-process KV transport for unit tests and warmup: peers are FakeTransport objects in one
process, messages are copied through per-tag queues."""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict

import numpy as np

from pdserve.shared.kv.base import Faults, KVTransport

_peers: dict[str, FakeTransport] = {}
_ids = itertools.count()


class FakeTransport(KVTransport):
    name = "fake"

    def __init__(self, faults: Faults | None = None) -> None:
        super().__init__(faults)
        self._address = f"fake-{next(_ids)}"
        self._inbox: dict[int, asyncio.Queue] = defaultdict(asyncio.Queue)
        _peers[self._address] = self

    @property
    def address(self) -> str:
        return self._address

    async def _send(self, peer: str, tag: int, payload: np.ndarray) -> None:
        target = _peers.get(peer)
        if target is None:
            raise ConnectionError(f"no fake peer {peer}")
        target._inbox[tag].put_nowait(np.array(payload, copy=True))

    async def recv(self, tag: int, out: np.ndarray) -> None:
        data = await self._inbox[tag].get()
        out.reshape(-1)[:] = data.reshape(-1).view(np.uint8)
        self._inbox.pop(tag, None)

    async def close(self) -> None:
        _peers.pop(self._address, None)
