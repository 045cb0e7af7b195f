"""A prefill worker killed while a decode worker copies KV out of its segment costs that copy
nothing but the handoff (pdserve/shared/kv/segment.py, two real processes): a mapping outlives its
owner, so a copy under way or made after the kill reads the bytes that were written, and a
segment never mapped before its owner died is refused with an error, not a crash."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

SIZE = 64 << 20
OWNER = f"prefill-{os.getpid()}"


def _owner(ref_q, hold_q, name):
    from pdserve.shared.kv.segment import Segment

    seg = Segment(2 * SIZE, name)
    refs = []
    for fill in (1, 2):
        ref, region = seg.take(SIZE)
        region[:] = fill
        refs.append(ref)
    ref_q.put(refs)
    hold_q.get()  # killed while waiting here


def _killed_owner() -> tuple[mp.Process, list]:
    ctx = mp.get_context("spawn")
    ref_q, hold_q = ctx.Queue(), ctx.Queue()
    owner = ctx.Process(target=_owner, args=(ref_q, hold_q, OWNER), daemon=True)
    owner.start()
    return owner, ref_q.get(timeout=60)


def test_copies_during_and_after_the_owners_death_read_what_it_wrote():
    from pdserve.shared.kv.segment import Segments

    reader = Segments()
    owner, (first, second) = _killed_owner()
    out = np.empty(SIZE, dtype=np.uint8)
    reader.read(OWNER, first, out)  # mapped while the owner lives
    copies, errors = [0], []

    def copy_on():  # copies back to back across the kill
        try:
            while copies[0] < 200:
                reader.read(OWNER, second, out)
                copies[0] += 1
        except Exception as e:  # noqa: BLE001 - the assertion below says what
            errors.append(e)

    copier = threading.Thread(target=copy_on)
    copier.start()
    while copies[0] < 3 and copier.is_alive():
        time.sleep(0.001)
    assert not errors, errors
    os.kill(owner.pid, signal.SIGKILL)
    owner.join(10)
    copier.join(120)
    assert owner.exitcode == -signal.SIGKILL and not errors and copies[0] == 200
    assert (out == 2).all()
    reader.read(OWNER, first, out)
    assert (out == 1).all()
    reader.prune()
    assert not reader.maps   # the dead owner's mapping is let go


def test_a_segment_whose_owner_died_before_it_was_mapped_is_refused():
    from pdserve.shared.kv.segment import Segments

    owner, (first, _) = _killed_owner()
    os.kill(owner.pid, signal.SIGKILL)
    owner.join(10)
    with pytest.raises(FileNotFoundError):
        Segments().read(OWNER, first, np.empty(SIZE, dtype=np.uint8))


def _stranger(ref, name, out_q):
    from pdserve.shared.kv.segment import Segments

    os.setuid(65534)   # (nobody)
    try:
        Segments().read(name, ref, np.empty(8, dtype=np.uint8))
        out_q.put("read")
    except OSError as e:
        out_q.put(type(e).__name__)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as another user")
def test_a_process_of_another_user_is_handed_no_segment():
    from pdserve.shared.kv.segment import Segment

    name = f"prefill-own-{os.getpid()}"
    seg = Segment(1 << 20, name)
    ref, _ = seg.take(4096)
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    stranger = ctx.Process(target=_stranger, args=(ref, name, out_q))
    stranger.start()
    try:
        assert out_q.get(timeout=60) == "PermissionError"
    finally:
        stranger.join(10)
        if stranger.is_alive():
            stranger.kill()
            stranger.join()
        seg.close()
