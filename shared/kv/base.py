"""The KV transport interface.

A handoff is one header (a KVHeader, fixed-size frame) on tag `kv_tag`, then one payload per
layer on tag `kv_tag + 1 + layer`. The receiver posts its receives for a tag it chose at
admission, so it needs no endpoint back to the sender; the sender opens (and caches) an
endpoint per peer address — a restarted peer has a new address, so never a stale endpoint.
"""

from __future__ import annotations

import abc

import numpy as np
import xxhash

from shared.messages import KVHeader

HEADER_BYTES = 16384


def checksum(payload: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(payload).cast("B"))


def pack_header(header: KVHeader) -> np.ndarray:
    raw = header.encode()
    if len(raw) > HEADER_BYTES:
        raise ValueError(f"KV header of {len(raw)} bytes exceeds {HEADER_BYTES}")
    frame = np.full(HEADER_BYTES, ord(" "), dtype=np.uint8)
    frame[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return frame


def unpack_header(frame: np.ndarray) -> KVHeader:
    return KVHeader.decode(frame.tobytes().rstrip(b" "))


class KVTransport(abc.ABC):
    name: str

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """This process's address, as peers use it (hex string)."""

    @abc.abstractmethod
    async def send(self, peer: str, kv_tag: int, header: KVHeader, layers: list[np.ndarray]) -> int:
        """Send a header and its layer payloads (uint8 arrays) to a peer; returns bytes sent."""

    @abc.abstractmethod
    async def recv(self, kv_tag: int, out: np.ndarray) -> None:
        """Receive the message on `kv_tag` into `out` (uint8, exactly the message's size)."""

    async def receive(self, kv_tag: int, num_layers: int, layer_nbytes: int) -> tuple[KVHeader, list[np.ndarray]]:
        """Receive a whole handoff: the header, then every layer."""
        frame = np.empty(HEADER_BYTES, dtype=np.uint8)
        await self.recv(kv_tag, frame)
        header = unpack_header(frame)
        if header.num_layers != num_layers or header.layer_nbytes != layer_nbytes:
            raise ValueError(f"{header.request_id}: KV layout {header.num_layers}x{header.layer_nbytes} B, "
                             f"expected {num_layers}x{layer_nbytes} B")
        layers = [np.empty(layer_nbytes, dtype=np.uint8) for _ in range(num_layers)]
        for i, buf in enumerate(layers):
            await self.recv(kv_tag + 1 + i, buf)
        return header, layers

    async def close(self) -> None:
        return None


def make(name: str) -> KVTransport:
    if name == "ucx":
        from shared.kv.ucx import UcxTransport

        return UcxTransport()
    if name == "fake":
        from shared.kv.fake import FakeTransport

        return FakeTransport()
    raise ValueError(f"unknown KV transport {name!r} (ucx, fake)")
