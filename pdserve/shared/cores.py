"""Cores lent between the workers of one host (PD_CORE_BOARD): a prefill worker's threads go to a
decode worker while the prefill worker is between passes, and come back at its next pass.

On a machine whose prefill and decode workers share the cores (the local stack, one node), a
decode step on the cores of both is ~1.8x faster than on its own half (SmolLM2 at batch 1-16,
2 cores), and the prefill pool is idle most of the time. Only decode workers borrow: their steps
are short, so a lender's threads are back within one decode step of its pass starting, while a
prefill pass that borrowed would hold a decode worker's core for a whole prompt (the
interference disaggregation is there to remove).

The board is a file in shared memory (/dev/shm) that every worker of the host maps: a slot per
lender with its name, its threads, whether it is in a pass, and the pid of the worker that
borrows them. Reading it costs no system call; a borrow and its return take the file's lock.
A lender that dies in a pass keeps its threads; one that dies between passes leaves a core that
nobody else uses, so a borrower losing it costs nothing."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from pdserve.shared import metrics

SLOT = struct.Struct("=32sHBxI")   # lender's name, its threads, in a pass (1/0), the borrower's pid (0: none)
SLOTS = 32
SIZE = SLOT.size * SLOTS


class Board:
    """One host's board, mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with self._locked(fd):
                if os.fstat(fd).st_size < SIZE:
                    os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self, fd: int | None = None) -> Iterator[None]:
        own = fd is None
        fd = os.open(self.path, os.O_RDWR) if fd is None else fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            if own:
                os.close(fd)

    def read(self, i: int) -> tuple[str, int, bool, int]:
        name, threads, busy, borrower = SLOT.unpack_from(self._map, i * SLOT.size)
        return name.rstrip(b"\0").decode(), threads, bool(busy), borrower

    def write(self, i: int, name: str, threads: int, busy: bool, borrower: int) -> None:
        SLOT.pack_into(self._map, i * SLOT.size, name.encode()[:32], threads, int(busy), borrower)

    def set_busy(self, i: int, busy: bool) -> None:
        self._map[i * SLOT.size + 34] = int(busy)   # (one byte: no lock, a borrower reads it each step)

    def set_borrower(self, i: int, pid: int) -> None:
        """Under the lock; the busy byte beside it is the lender's alone (a slot rewritten whole could undo a
        pass's start written between its read and its write)."""
        struct.pack_into("=I", self._map, i * SLOT.size + 36, pid)

    def close(self) -> None:
        self._map.close()


class Lender:
    """A prefill worker's side: its slot (found by its name, or a free one) and whether it is in a pass."""

    def __init__(self, board: Board, name: str, threads: int):
        self.board = board
        with board._locked():
            slots = [board.read(i) for i in range(SLOTS)]
            slot = next((i for i, s in enumerate(slots) if s[0] == name),
                        next((i for i, s in enumerate(slots) if not s[0]), None))
            if slot is None:
                raise RuntimeError(f"the core board {board.path} has no free slot for {name}")
            board.write(slot, name, threads, True, 0)   # (busy until its first step says otherwise)
        self.slot, self.busy = slot, True

    def working(self, busy: bool) -> None:
        if busy != self.busy:
            self.board.set_busy(self.slot, busy)
            self.busy = busy


class Borrower:
    """A decode worker's side: before each step, how many threads to run it on — its own, plus
    an idle lender's that it holds (or takes now, if one is free), none while that lender works."""

    def __init__(self, board: Board, own: int):
        self.board, self.own, self.pid = board, own, os.getpid()
        self.held: int | None = None   # the slot whose threads it holds
        self.lent = 0

    def threads(self) -> int:
        if self.held is not None:
            _, _, busy, borrower = self.board.read(self.held)
            if busy or borrower != self.pid:
                self.give_back()
        if self.held is None:
            self._take()
        return self.own + self.lent

    def give_back(self) -> None:
        """Its lender's threads returned (its lender works again, or it has nothing to step)."""
        if self.held is None:
            return
        with self.board._locked():
            if self.board.read(self.held)[3] == self.pid:
                self.board.set_borrower(self.held, 0)
        self.held, self.lent = None, 0

    def _take(self) -> None:
        free = [i for i in range(SLOTS) if self._free(self.board.read(i))]
        if not free:   # (the common case while lenders work: no lock taken)
            return
        with self.board._locked():
            for i in free:
                slot = self.board.read(i)
                if self._free(slot):
                    self.board.set_borrower(i, self.pid)
                    self.held, self.lent = i, slot[1]
                    return

    @staticmethod
    def _free(slot: tuple[str, int, bool, int]) -> bool:
        name, threads, busy, borrower = slot
        return bool(name) and threads > 0 and not busy and (borrower == 0 or not _alive(borrower))


def _alive(pid: int) -> bool:
    """A borrower that died holding a slot holds it no more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Share:
    """A worker's part in its host's board, on the engine thread around each step: a prefill
    worker says whether it is in a pass; a decode worker sets its torch threads for the step."""

    def __init__(self, path: str | Path, role: str, name: str, own: int):
        board = Board(path)
        self.lender = Lender(board, name, own) if role == "prefill" else None
        self.borrower = Borrower(board, own) if role == "decode" else None
        self.threads = own

    def before_step(self) -> None:
        if self.lender is not None:
            self.lender.working(True)
        if self.borrower is None:
            return
        if (n := self.borrower.threads()) != self.threads:
            torch.set_num_threads(n)   # (on the thread that runs the step: OpenMP's count is per thread)
            self.threads = n
        if self.borrower.lent:
            metrics.LENT_STEPS.inc()

    def after_step(self, has_work: bool) -> None:
        if self.lender is not None:
            self.lender.working(has_work)
        if self.borrower is not None and not has_work:
            self.borrower.give_back()
