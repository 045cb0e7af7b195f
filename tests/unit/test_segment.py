"""Same-host KV segments (pdserve/shared/kv/segment.py): the region allocator, and a payload written
by one side read by the other, the segment handed over on its owner's socket (here both in
one process; a killed owner in tests/integration/test_segment_peer_failure.py)."""

from __future__ import annotations

import os
import random
import secrets

import numpy as np
import pytest

from pdserve.shared.kv.segment import ALIGN, Extents, Segment, Segments, host_identity, make_segment


def owner() -> str:
    """A worker id of its own (its address is taken while its segment is open)."""
    return f"prefill-{secrets.token_hex(4)}"


def test_extents_take_first_fit_and_merge_what_is_given_back():
    e = Extents(10 * ALIGN)
    a, b, c = e.take(1), e.take(2 * ALIGN), e.take(ALIGN + 1)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and e.used_bytes == 5 * ALIGN
    assert e.take(6 * ALIGN) is None            # 5 left
    e.give(b)                                   # a hole of 2 before c
    assert e.take(3 * ALIGN) == 5 * ALIGN       # does not fit the hole: after c
    assert e.take(2 * ALIGN) == ALIGN           # fits it exactly
    for offset in list(e.used):
        e.give(offset)
    assert e.free == [(0, 10 * ALIGN)] and e.used_bytes == 0


def test_extents_never_overlap_and_end_whole_in_any_order():
    rng = random.Random(7)
    e, held = Extents(256 * ALIGN), []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            e.give(held.pop(rng.randrange(len(held)))[0])
        elif (offset := e.take(n := rng.randrange(1, 20 * ALIGN))) is not None:
            held.append((offset, n))
        spans = sorted([(o, o + e.used[o]) for o, _ in held] + [(o, o + n) for o, n in e.free])
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # used and free tile, no overlap
        assert sum(b - a for a, b in spans) == 256 * ALIGN
    for offset, _ in held:
        e.give(offset)
    assert e.free == [(0, 256 * ALIGN)]


def test_a_payload_in_a_segment_is_read_back_from_the_segment_its_owner_hands_over():
    me = owner()
    seg, reader = Segment(1 << 20, me), Segments()
    assert seg.host == reader.host == host_identity()
    ref, region = seg.take(100_000)
    payload = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8)
    region[:] = payload
    out = np.empty(100_000, dtype=np.uint8)
    reader.read(me, ref, out)
    assert np.array_equal(out, payload)
    second, region2 = seg.take(10)
    region2[:] = 9
    reader.read(me, second, out[:10])
    assert (out[:10] == 9).all() and len(reader.maps) == 1   # mapped once
    seg.give(ref)
    seg.give(second)
    seg.close()


def test_another_file_an_absent_owner_or_past_the_end_is_refused():
    """A notice names only an inode and an offset: the file is whichever the placed worker
    hands over, and one that is not the notice's is refused (so is another's address)."""
    me, other = owner(), owner()
    seg, theirs, reader = Segment(64 << 10, me), Segment(64 << 10, other), Segments()
    ref, _ = seg.take(4096)
    with pytest.raises(FileNotFoundError, match="another file"):   # (the owner restarted; or theirs named)
        reader.read(me, ref.model_copy(update={"inode": ref.inode + 1}), np.empty(8, np.uint8))
    with pytest.raises(FileNotFoundError, match="another file"):
        reader.read(other, ref, np.empty(8, np.uint8))
    with pytest.raises(FileNotFoundError, match="not handed over"):
        reader.read(owner(), ref, np.empty(8, np.uint8))
    with pytest.raises(OSError, match="past the end"):
        reader.read(me, ref.model_copy(update={"offset": 60 << 10}), np.empty(8 << 10, np.uint8))
    assert set(reader.maps) == {me}
    seg.close()
    theirs.close()
    reader.prune()
    assert not reader.maps   # its owner closed it: the mapping is dropped


def test_no_segment_without_bytes_or_a_host(monkeypatch):
    from pdserve.shared.kv import segment

    assert make_segment(0, owner()) is None
    made = make_segment(1 << 16, owner())
    assert made is not None and made.host == host_identity() != ""
    made.close()
    monkeypatch.setattr(segment, "host_identity", lambda: "")   # the system does not say: never "same host"
    assert make_segment(1 << 16, owner()) is None


def test_a_second_segment_at_a_taken_address_is_none_and_the_first_serves_on():
    me = owner()
    first = Segment(1 << 16, me)
    assert make_segment(1 << 16, me) is None   # (another process of that id on this host)
    ref, region = first.take(8)
    region[:] = 7
    out = np.empty(8, np.uint8)
    Segments().read(me, ref, out)
    assert (out == 7).all()
    first.close()


def test_one_worker_id_in_two_scopes_is_two_segments_each_read_in_its_own():
    me = owner()
    a, b = Segment(1 << 16, me, "stack-a"), Segment(1 << 16, me, "stack-b")   # (two stacks on one host)
    refs = []
    for seg, fill in ((a, 1), (b, 2)):
        ref, region = seg.take(8)
        region[:] = fill
        refs.append(ref)
    out = np.empty(8, np.uint8)
    for scope, ref, fill in (("stack-a", refs[0], 1), ("stack-b", refs[1], 2)):
        Segments(scope).read(me, ref, out)
        assert (out == fill).all()
    a.close()
    b.close()


def test_the_segment_handed_over_cannot_be_mapped_for_writing():
    import mmap
    import socket

    from pdserve.shared.kv.segment import address

    me = owner()
    seg = Segment(1 << 16, me)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(address(me))
        _, fds, _, _ = socket.recv_fds(conn, 1, 1)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fds[0], 0, prot=mmap.PROT_READ | mmap.PROT_WRITE)   # (sealed: its owner alone writes)
    finally:
        for fd in fds:
            os.close(fd)
        seg.close()
