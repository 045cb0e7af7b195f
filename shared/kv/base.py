"""The KV transport interface: bulk bytes only.

The handoff's typed header (KVHeader: fingerprint, layout, checksums, first token) goes over
NATS; the transport carries one payload per layer on tag `kv_tag + 1 + layer`. The receiver
posts its receives when the header arrives — a UCX receive left posted keeps a progress
thread spinning on a core — for a tag it chose at admission, so it needs no endpoint back
to the sender; the sender opens (and caches) an endpoint per peer address: a restarted
peer has a new address, so never a stale endpoint.
"""

from __future__ import annotations

import abc
import asyncio

import numpy as np
import xxhash

def checksum(payload: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(payload).cast("B"))


def layer_tag(kv_tag: int, layer: int) -> int:
    return kv_tag + 1 + layer


class KVTransport(abc.ABC):
    name: str

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """This process's address, as peers use it (hex string)."""

    @abc.abstractmethod
    async def send(self, peer: str, kv_tag: int, layers: list[np.ndarray]) -> int:
        """Send layer payloads (uint8 arrays) to a peer; returns bytes sent."""

    @abc.abstractmethod
    async def recv(self, kv_tag: int, out: np.ndarray) -> None:
        """Receive the message on `kv_tag` into `out` (uint8, exactly the message's size)."""

    async def receive(self, kv_tag: int, num_layers: int, layer_nbytes: int) -> list[np.ndarray]:
        """Receive every layer of a handoff (posted together; they complete in any order)."""
        layers = [np.empty(layer_nbytes, dtype=np.uint8) for _ in range(num_layers)]
        await asyncio.gather(*(self.recv(layer_tag(kv_tag, i), buf) for i, buf in enumerate(layers)))
        return layers

    async def forget(self, peer: str) -> None:
        """Drop any connection state for `peer` (after an aborted send): the next send starts fresh."""
        return None

    async def close(self) -> None:
        return None


def make(name: str, ucx_progress_mode: str = "thread") -> KVTransport:
    if name == "ucx":
        from shared.kv.ucx import UcxTransport

        return UcxTransport(ucx_progress_mode)
    if name == "fake":
        from shared.kv.fake import FakeTransport

        return FakeTransport()
    raise ValueError(f"unknown KV transport {name!r} (ucx, fake)")
