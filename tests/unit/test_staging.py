"""Staging buffers for received KV: reused, sized, bounded; a broken-off receive keeps its buffer."""

import asyncio

import numpy as np
import pytest
from localbus import LocalBus

from shared import subjects
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.sequence import SamplingParams
from shared.kv import receiver
from shared.kv.receiver import KVBrokeOff, KVInbox, KVReceiver
from shared.kv.staging import MIN_CLASS, Staging, size_class
from shared.messages import KVLayer


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


def test_a_receive_that_broke_off_does_not_give_its_buffer_back(tiny, monkeypatch):
    """Only a completed receive returns its buffer: a transport may still write one whose
    receive failed or was given up."""
    staging = Staging()
    monkeypatch.setattr(receiver, "STAGING", staging)

    class Broken:
        async def recv(self, tag, out):
            raise OSError("Input/output error")

    async def scenario():
        bus = LocalBus()
        dst = Engine(tiny, EngineConfig(num_blocks=64))
        inbox = KVInbox(bus, "d")
        await inbox.start()
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        rx = inbox.add(KVReceiver.for_engine(dst, dst.reserve("r", list(range(3, 40)), params), 1 << 20, Broken(),
                                             bus, prefill_worker="p"))
        await bus.publish(subjects.decode_kv("d"), KVLayer(
            request_id="r", prefill_worker="p", fingerprint=dst.fingerprint, tag=(1 << 20) + 1, layer=0,
            num_blocks=1, first_block=0, checksums=[0]))
        with pytest.raises(KVBrokeOff):
            await asyncio.wait_for(rx.wait(), 5)

    asyncio.run(scenario())
    assert staging.made == 1 and staging.idle_bytes == 0
