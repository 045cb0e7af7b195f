"""KV between workers on one host through a shared-memory segment, not a transport.

UCX with peer-failure handling moves same-host KV at about half a memcpy at best (`make
bench-transfer`): each message costs thread wakeups on both sides, and cma's
process_vm_readv plateaus near half the memory's speed. Here the prefill worker writes each
payload once into a segment of its own (an anonymous memfd, `Segment`), the KVLayer notice
says where (`SegmentRef`), and the decode worker copies it out of its mapping of that segment
(`Segments.read`) into a staging buffer — one copy, no transport message.

- **Same host.** Two processes share a host when `host_identity()` is equal: the boot, the
  network and PID namespaces and the user. The decode worker says its identity in its
  PrefillJob (`decode_host`); the prefill worker places payloads in its segment only for a
  job with its own identity, else (and when the segment is full) it sends over the transport.
- **Opening.** The decode worker opens the segment as /proc/<pid>/fd/<fd> of the prefill
  worker (the notice names the file's inode, so a reused pid or fd is never mistaken for it),
  maps it read-only and keeps the mapping. A mapping outlives the process that made it, so a
  prefill worker killed mid-copy leaves its receivers reading memory that is still there.
  Mappings of segments whose owner is gone are dropped when a new segment is mapped.
- **Leased and checksummed as before.** A region of the segment is held until the handoff
  ends (the decode side's ack, the lease's end, a cancel): then it is written again. A
  decode side still copying after its lease ended may read bytes of a later payload; every
  block is checked against the notice's checksum after the copy, so it never uses them.
- **What UCX still carries:** KV between hosts, and same-host KV that does not fit.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
from pathlib import Path

import numpy as np

from shared.messages import SegmentRef

log = logging.getLogger("kv.segment")
ALIGN = 4096


def host_identity() -> str:
    """Equal for two processes that can map each other's segments: same boot, same network
    and PID namespaces (separate ones are separate hosts, as far as the workers can tell), same
    user, "" where the system does not say (then no segment is used)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        net, pid = (os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("net", "pid"))
    except OSError:
        return ""
    return f"{boot}:{net}:{pid}:{os.getuid()}"


class Extents:
    """First-fit allocation of [0, size) in ALIGN-sized units, freed extents merged."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)] if size else []  # (offset, length), by offset
        self.used: dict[int, int] = {}                                     # offset -> length

    def take(self, nbytes: int) -> int | None:
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (offset, length) in enumerate(self.free):
            if length >= need:
                if length == need:
                    del self.free[i]
                else:
                    self.free[i] = (offset + need, length - need)
                self.used[offset] = need
                return offset
        return None

    def give(self, offset: int) -> None:
        length = self.used.pop(offset)
        i = bisect.bisect(self.free, (offset, length))
        if i < len(self.free) and offset + length == self.free[i][0]:  # merge with the next
            length += self.free.pop(i)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:  # and the one before
            offset, length = self.free[i - 1][0], self.free[i - 1][1] + length
            i -= 1
            del self.free[i]
        self.free.insert(i, (offset, length))

    @property
    def used_bytes(self) -> int:
        return sum(self.used.values())


class Segment:
    """The prefill worker's side: `nbytes` of shared memory, regions taken per payload and
    given back when their handoff ends."""

    def __init__(self, nbytes: int) -> None:
        self.host = host_identity()
        self.fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.map = mmap.mmap(self.fd, nbytes) if nbytes else None
        self.bytes = np.frombuffer(self.map, dtype=np.uint8) if self.map is not None else np.empty(0, np.uint8)
        self.inode = os.fstat(self.fd).st_ino
        self.extents = Extents(nbytes)
        self.full = 0  # payloads that did not fit (sent over the transport instead)

    def take(self, nbytes: int) -> tuple[SegmentRef, np.ndarray] | None:
        """A region for a payload of `nbytes` — where it is, and the bytes to write it into —
        or None when none is free."""
        offset = self.extents.take(nbytes)
        if offset is None:
            self.full += 1
            return None
        ref = SegmentRef(pid=os.getpid(), fd=self.fd, inode=self.inode, offset=offset)
        return ref, self.bytes[offset:offset + nbytes]

    def give(self, ref: SegmentRef) -> None:
        self.extents.give(ref.offset)

    def close(self) -> None:
        self.bytes = np.empty(0, np.uint8)
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a region is still referenced: unmapped when that goes
                pass
        os.close(self.fd)


def make_segment(nbytes: int) -> Segment | None:
    """The prefill worker's segment, or None (KV over the transport only) when `nbytes` is 0 or
    the system has no memfd or does not say which host this is."""
    if not nbytes:
        return None
    try:
        segment = Segment(nbytes)
    except (OSError, AttributeError) as e:  # (os.memfd_create: Linux only)
        log.warning("no shared-memory segment for KV (%s): same-host KV goes over the transport", e)
        return None
    return segment if segment.host else None


class Segments:
    """The decode worker's side: other processes' segments, mapped on first use."""

    def __init__(self) -> None:
        self.host = host_identity()
        self.maps: dict[tuple[int, int, int], np.ndarray] = {}  # (pid, fd, inode) -> its bytes
        self.usable = True  # false once the system refused to open one (then this side says no host)

    def read(self, ref: SegmentRef, out: np.ndarray) -> None:
        """Copy the payload at `ref` into `out` (uint8, the payload's size). Raises OSError
        when the segment cannot be opened (its owner is gone) or is too short."""
        src = self._mapped(ref)
        if ref.offset < 0 or ref.offset + out.nbytes > src.nbytes:
            raise OSError(f"payload at {ref.offset}+{out.nbytes} past the end of segment {ref.pid}/{ref.fd}")
        np.copyto(out.reshape(-1), src[ref.offset:ref.offset + out.nbytes])

    def _mapped(self, ref: SegmentRef) -> np.ndarray:
        key = (ref.pid, ref.fd, ref.inode)
        if (src := self.maps.get(key)) is not None:
            return src
        self.prune()
        try:
            fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except PermissionError:
            self.usable = False
            log.warning("may not open the KV segments of other processes here; KV goes over the transport")
            raise
        try:
            if os.fstat(fd).st_ino != ref.inode:
                raise FileNotFoundError(f"segment {ref.pid}/{ref.fd} is gone (its process ended)")
            src = np.frombuffer(mmap.mmap(fd, 0, prot=mmap.PROT_READ), dtype=np.uint8)
        finally:
            os.close(fd)
        self.maps[key] = src
        return src

    def prune(self) -> None:
        """Drop the mappings of segments whose owner is gone."""
        for key in list(self.maps):
            pid, fd, inode = key
            try:
                alive = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode
            except OSError:
                alive = False
            if not alive:
                self.maps.pop(key, None)  # (another thread's copy may have pruned it too)
