"""The KV transport interface: bulk bytes only, one tagged message at a time.

What a payload is, and whether it arrived intact, is said over NATS (KVLayer notices with
per-block checksums; see pdserve/shared/kv/sender.py and receiver.py). The receiver posts a receive
only when a notice says its payload is on the way (so no receive waits on a message that
may never come) on a tag inside the range it chose at admission, so it
needs no endpoint back to the sender. The sender opens (and caches) one endpoint per peer
address: a restarted peer has a new address, so it is never reached through a stale one.

Fault injection (tests and drills, off by default): `corrupt_rate` flips one byte in that
fraction of payloads whose resend is below `corrupt_sends` (on a copy: the pool is never
touched); `delay_s` holds each send that long.
"""

from __future__ import annotations

import abc
import asyncio
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from pdserve.shared.messages import DeviceRef, SegmentRef

if TYPE_CHECKING:
    import torch

TAG_SPAN = 1 << 20  # tags of one handoff: kv_tag .. kv_tag + TAG_SPAN - 1


def checksum(payload: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(payload).data.cast("B"))


def block_checksums(blocks: np.ndarray) -> list[int]:
    """xxh3-64 of each row of a (n_blocks, block_nbytes) uint8 array."""
    return [xxhash.xxh3_64_intdigest(memoryview(row)) for row in blocks]


@dataclass
class Faults:
    corrupt_rate: float = 0.0
    corrupt_sends: int = 1
    delay_s: float = 0.0

    def strikes(self, resend: int) -> bool:
        return resend < self.corrupt_sends and self.corrupt_rate > 0 and random.random() < self.corrupt_rate

    def apply(self, payload: np.ndarray, resend: int) -> tuple[np.ndarray, bool]:
        if self.strikes(resend):
            payload = np.array(payload, copy=True)
            self.apply_in_place(payload, resend, strikes=True)
            return payload, True
        return payload, False

    def apply_in_place(self, payload: np.ndarray, resend: int, strikes: bool = False) -> bool:
        """Flip one byte of `payload` itself (a payload in a shared-memory segment: its own region)."""
        if strikes or self.strikes(resend):
            flat = payload.reshape(-1)
            flat[random.randrange(flat.size)] ^= 0xFF
            return True
        return False

    async def delay(self) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)


class KVTransport(abc.ABC):
    name: str

    def __init__(self, faults: Faults | None = None) -> None:
        self.faults = faults or Faults()
        self.corrupted = 0  # payloads that fault injection corrupted

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """This process's address, as peers use it."""

    async def send(self, peer: str, tag: int, payload: np.ndarray, resend: int = 0) -> int:
        """Send one uint8 payload to a peer on `tag`; returns bytes sent."""
        payload, corrupted = self.faults.apply(payload, resend)
        self.corrupted += corrupted
        await self.faults.delay()
        await self._send(peer, tag, payload)
        return payload.nbytes

    @abc.abstractmethod
    async def _send(self, peer: str, tag: int, payload: np.ndarray) -> None: ...

    @abc.abstractmethod
    async def recv(self, tag: int, out: np.ndarray) -> None:
        """Receive the message on `tag` into `out` (uint8, exactly the message's size)."""

    @property
    def host(self) -> str:
        """This process's host identity where it places or reads same-host payloads ("": none)."""
        return ""

    def place(self, peer_host: str, nbytes: int) -> tuple[SegmentRef, np.ndarray] | None:
        """Where a payload of `nbytes` for a peer on `peer_host` is written for the peer to read
        it in place (same host: pdserve/shared/kv/same_host.py), and the bytes to write it into; None:
        it is sent on its tag."""
        return None

    def release(self, ref: SegmentRef) -> None:
        """A placed payload's handoff is over: its region may be written again."""
        return None

    async def read(self, owner: str, ref: SegmentRef, out: np.ndarray) -> None:
        """Copy the payload `owner` placed at `ref` into `out` (OSError: it cannot be had)."""
        raise OSError("this transport carries no placed payloads")

    @property
    def device(self) -> str:
        """The kind of pool ("cuda") this process shares, or reads from a peer on its host, in place
        (device-direct KV: pdserve/shared/engine/kv_device.py); "": none."""
        return ""

    @property
    def pool_handle(self) -> str:
        """This process's shared pool as a DeviceRef names it ("": none)."""
        return ""

    def read_device(self, owner: str, ref: DeviceRef, layers: tuple[int, int], block_shape: tuple[int, ...],
                    dtype: torch.dtype) -> torch.Tensor:
        """Layers [first, first + count) of the blocks at `ref` of `owner`'s pool, gathered on its device
        (OSError: the pool cannot be had; ValueError: not laid out so). Blocking: run it off the event loop."""
        raise OSError("this transport reads no pool")

    def has_endpoint(self, peer: str) -> bool:
        return False

    async def forget(self, peer: str) -> None:
        """Drop any connection state for `peer` (it stopped answering): the next send starts fresh."""
        return None

    async def close(self) -> None:
        return None


def create_transport(name: str, ucx_progress_mode: str = "thread", faults: Faults | None = None,
         ucx_error_handling: bool = True) -> KVTransport:
    if name == "ucx":
        from pdserve.shared.kv.ucx import UcxTransport

        return UcxTransport(ucx_progress_mode, faults, ucx_error_handling)
    if name == "fake":
        from pdserve.shared.kv.fake import FakeTransport

        return FakeTransport(faults)
    if name == "none":
        return NoTransport(faults)
    raise ValueError(f"unknown KV transport {name!r} (ucx, none, fake)")


class NoTransport(KVTransport):
    """No transport between processes (PD_KV_TRANSPORT=none): only the same-host segment
    carries KV (pdserve/shared/kv/same_host.py); a payload sent on a tag fails its handoff, and the
    decode worker prefills the prompt itself."""

    name = "none"

    @property
    def address(self) -> str:
        return ""

    async def _send(self, peer: str, tag: int, payload: np.ndarray) -> None:
        raise ConnectionError("no KV transport (PD_KV_TRANSPORT=none): the payload did not fit the segment, "
                              "or the decode worker is on another host")

    async def recv(self, tag: int, out: np.ndarray) -> None:
        raise ConnectionError("no KV transport (PD_KV_TRANSPORT=none)")
