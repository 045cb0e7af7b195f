"""Staging buffers for received KV: reused, sized, bounded (a broken-off receive keeping its
buffer: tests/unit/test_kv_handoff.py)."""

import numpy as np

from pdserve.shared.kv.staging import MIN_CLASS, Staging, size_class


def test_size_classes_are_powers_of_two_from_the_minimum():
    assert size_class(1) == MIN_CLASS
    assert size_class(MIN_CLASS + 1) == 2 * MIN_CLASS
    assert size_class(6 << 20) == 8 << 20
    assert size_class(8 << 20) == 8 << 20


def test_a_given_back_buffer_is_handed_out_again_for_its_class():
    s = Staging()
    a = s.take(5 << 20)
    assert a.nbytes == 5 << 20 and a.dtype == np.uint8
    a[:] = 7
    s.give(a)
    b = s.take(6 << 20)                       # same 8 MiB class: the same memory
    assert np.shares_memory(a, b) and b.nbytes == 6 << 20
    assert (s.made, s.reused) == (1, 1)
    assert not np.shares_memory(s.take(5 << 20), b)  # b is out: a new one


def test_idle_buffers_are_bounded_and_foreign_ones_are_not_kept():
    s = Staging(keep_bytes=2 << 20)
    bufs = [s.take(1 << 20) for _ in range(3)]
    for b in bufs:
        s.give(b)
    assert s.idle_bytes == 2 << 20            # the third was dropped
    s.give(np.empty(3 << 20, dtype=np.uint8))  # not a class size: not ours
    assert s.idle_bytes == 2 << 20

