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
- **Handing over.** The prefill worker listens on a Unix socket in the abstract namespace
  named by its deployment's scope and its worker id (`address`), and gives the segment's file
  descriptor (SCM_RIGHTS) to each process of its own user that connects; the file is sealed
  against writes through any later mapping (F_SEAL_FUTURE_WRITE): only the owner writes it.
  The decode worker connects to the address of the prefill worker its handoff was placed with
  (never to one a message names: a placed prefill worker can make it map its own segment,
  nothing else), checks the file is the one the notice names (its inode), maps it read-only
  and keeps the mapping, and the connection: its end says the owner is gone. A mapping
  outlives the process that made it, so a prefill worker killed mid-copy leaves its receivers
  reading memory that is still there. Mappings of segments whose owner is gone are dropped
  when a new segment is mapped.
- **Leased and checksummed as before.** A region of the segment is taken until the handoff
  ends (the decode side's ack, the lease's end, a cancel): then it is written again. A
  decode side still copying after its lease ended may read bytes of a later payload; every
  block is checked against the notice's checksum after the copy, so it never uses them.
- **What UCX still carries:** KV between hosts, and same-host KV that does not fit.
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import mmap
import os
import socket
import struct
import threading
from pathlib import Path

import numpy as np

from pdserve.shared.messages import SegmentRef

log = logging.getLogger("kv.segment")
ALIGN = 4096
_PEERCRED = "3i"   # SO_PEERCRED's struct ucred: pid, uid, gid
_SEAL_FUTURE_WRITE = 0x10   # (F_SEAL_FUTURE_WRITE, Linux 5.1: not in Python's fcntl)


def address(worker_id: str, scope: str = "") -> str:
    """Where prefill worker `worker_id` of deployment `scope` hands its segment over (the
    abstract namespace: per network namespace, no file)."""
    return f"\0pdserve-kv/{scope}/{worker_id}"


def closed(conn: socket.socket) -> bool:
    """Whether the other end of `conn` (which never writes) has closed it."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class Giver:
    """The prefill worker's socket: each connecting process of its own user gets the segment's
    file descriptor; the connections stay open until this process ends (the readers' sign of
    its life)."""

    def __init__(self, fd: int, worker_id: str, scope: str) -> None:
        self.fd, self.readers = fd, list[socket.socket]()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(address(worker_id, scope))
        except OSError:
            self.sock.close()
            raise
        self.sock.listen(64)
        self.thread = threading.Thread(target=self._serve, name="kv-segment-giver", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            _, uid, _ = struct.unpack(_PEERCRED, conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                 struct.calcsize(_PEERCRED)))
            if uid != os.getuid():
                conn.close()
                continue
            try:
                socket.send_fds(conn, [b"k"], [self.fd])
            except OSError:
                conn.close()
                continue
            for gone in [c for c in self.readers if closed(c)]:   # (readers that have ended)
                gone.close()
                self.readers.remove(gone)
            self.readers.append(conn)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # (wakes the accept: a close alone leaves the address bound)
        except OSError:
            pass
        # the address is free once the woken accept has returned too (it holds the socket until
        # then: on a busy machine, long enough for a new segment of the same name to find it taken)
        self.thread.join(timeout=5.0)
        self.sock.close()
        for conn in self.readers:
            conn.close()


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
    given back when their handoff ends, handed over at worker `worker_id`'s address."""

    def __init__(self, nbytes: int, worker_id: str, scope: str = "") -> None:
        self.host = host_identity()
        self.fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, nbytes)
        self.map = mmap.mmap(self.fd, nbytes) if nbytes else None
        # (its size fixed, and no mapping made from now on can write it: the readers' are read-only)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _SEAL_FUTURE_WRITE)
        self.bytes = np.frombuffer(self.map, dtype=np.uint8) if self.map is not None else np.empty(0, np.uint8)
        self.inode = os.fstat(self.fd).st_ino
        self.extents = Extents(nbytes)
        self.full = 0  # payloads that did not fit (sent over the transport instead)
        try:
            self.giver = Giver(self.fd, worker_id, scope)
        except OSError:   # (its address taken)
            self.close_memory()
            raise

    def take(self, nbytes: int) -> tuple[SegmentRef, np.ndarray] | None:
        """A region for a payload of `nbytes` — where it is, and the bytes to write it into —
        or None when none is free."""
        offset = self.extents.take(nbytes)
        if offset is None:
            self.full += 1
            return None
        ref = SegmentRef(inode=self.inode, offset=offset)
        return ref, self.bytes[offset:offset + nbytes]

    def give(self, ref: SegmentRef) -> None:
        self.extents.give(ref.offset)

    def close(self) -> None:
        self.giver.close()
        self.close_memory()

    def close_memory(self) -> None:
        self.bytes = np.empty(0, np.uint8)
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a region is still referenced: unmapped when that goes
                pass
        os.close(self.fd)


def make_segment(nbytes: int, worker_id: str, scope: str = "") -> Segment | None:
    """Prefill worker `worker_id`'s segment, or None (KV over the transport only) when `nbytes`
    is 0 or the system has no memfd, does not say which host this is, or the address is taken."""
    if not nbytes or not host_identity():
        return None
    try:
        segment = Segment(nbytes, worker_id, scope)
    except (OSError, AttributeError) as e:  # (os.memfd_create: Linux only)
        log.warning("no shared-memory segment for KV (%s): same-host KV goes over the transport", e)
        return None
    return segment


class Segments:
    """The decode worker's side: other processes' segments, mapped on first use."""

    def __init__(self, scope: str = "") -> None:
        self.host, self.scope = host_identity(), scope   # (scope: the deployment's, as its prefill workers')
        self.maps: dict[str, tuple[int, np.ndarray, socket.socket]] = {}  # by owner: (inode, bytes, connection)
        self._lock = threading.Lock()   # (copies run on threads too)

    def mapped(self, owner: str, ref: SegmentRef) -> bool:
        """Whether the segment of `ref` is mapped here already (a read then waits on no one)."""
        return self._mapping(owner, ref) is not None

    def _mapping(self, owner: str, ref: SegmentRef) -> np.ndarray | None:
        """The mapping of `ref`'s segment (None: not mapped, or `owner`'s is another file now)."""
        mapped = self.maps.get(owner)
        return mapped[1] if mapped is not None and mapped[0] == ref.inode else None

    def read(self, owner: str, ref: SegmentRef, out: np.ndarray) -> None:
        """Copy the payload at `ref` in prefill worker `owner`'s segment into `out` (uint8, the
        payload's size). Raises OSError when the segment cannot be had (its owner is gone, it
        is another file than the notice's) or is too short."""
        src = self._mapped(owner, ref)
        if ref.offset < 0 or ref.offset + out.nbytes > src.nbytes:
            raise OSError(f"payload at {ref.offset}+{out.nbytes} past the end of {owner}'s segment")
        np.copyto(out.reshape(-1), src[ref.offset:ref.offset + out.nbytes])

    def _mapped(self, owner: str, ref: SegmentRef) -> np.ndarray:
        if (src := self._mapping(owner, ref)) is not None:   # (no lock: a copy on the event loop never waits)
            return src
        with self._lock:   # (one first mapping at a time, on a thread: it waits on the owner)
            if (src := self._mapping(owner, ref)) is not None:   # (another thread's, meanwhile)
                return src
            self.prune()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                conn.settimeout(5)
                conn.connect(address(owner, self.scope))
                _, fds, _, _ = socket.recv_fds(conn, 1, 1)
            except OSError as e:
                conn.close()
                raise FileNotFoundError(f"{owner}'s segment is not handed over here ({e})") from e
            if not fds:   # (it let go: this process is not of its user)
                conn.close()
                raise PermissionError(f"{owner} handed over no segment")
            try:
                if os.fstat(fds[0]).st_ino != ref.inode:
                    conn.close()
                    raise FileNotFoundError(f"{owner}'s segment is another file than the notice's")
                src = np.frombuffer(mmap.mmap(fds[0], 0, prot=mmap.PROT_READ), dtype=np.uint8)
            finally:
                for fd in fds:
                    os.close(fd)
            if (old := self.maps.get(owner)) is not None:   # (its former segment: the owner restarted)
                old[2].close()
            self.maps[owner] = (ref.inode, src, conn)
            return src

    def prune(self) -> None:
        """Drop the mappings of segments whose owner is gone (its end of the connection closed)."""
        for owner, (_, _, conn) in list(self.maps.items()):
            if closed(conn):
                conn.close()
                self.maps.pop(owner, None)
