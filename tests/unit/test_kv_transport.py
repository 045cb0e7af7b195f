"""The transport interface itself (fake backend): tagged payloads, checksums, fault injection."""

import asyncio

import numpy as np

from pdserve.shared.kv import Faults, block_checksums, checksum, create_transport


def test_a_payload_arrives_whole_on_its_tag():
    async def run():
        a, b = create_transport("fake"), create_transport("fake")
        payload = np.arange(3 * 4096, dtype=np.uint32).view(np.uint8)
        out = np.empty_like(payload)
        recv = asyncio.create_task(b.recv(7, out))
        sent = await a.send(b.address, 7, payload)
        await recv
        return payload, out, sent

    payload, out, sent = asyncio.run(run())
    assert sent == payload.nbytes and np.array_equal(payload, out)


def test_fault_injection_flips_one_byte_of_a_copy_only_for_early_sends():
    async def run():
        a, b = create_transport("fake", faults=Faults(corrupt_rate=1.0, corrupt_sends=1)), create_transport("fake")
        payload = np.zeros((4, 1024), dtype=np.uint8)
        first, second = np.empty_like(payload), np.empty_like(payload)
        await a.send(b.address, 1, payload.reshape(-1), resend=0)
        await b.recv(1, first)
        await a.send(b.address, 2, payload.reshape(-1), resend=1)
        await b.recv(2, second)
        return payload, first, second, a.corrupted

    payload, first, second, corrupted = asyncio.run(run())
    assert not payload.any()                            # the source is never touched
    assert np.count_nonzero(first) == 1 and corrupted == 1
    assert sum(x != y for x, y in zip(block_checksums(first), block_checksums(payload))) == 1
    assert np.array_equal(second, payload)              # a re-send goes through clean


def test_checksum_sees_a_single_flipped_byte():
    payload = np.arange(4096, dtype=np.uint8)
    before = checksum(payload)
    payload[1234] ^= 1
    assert checksum(payload) != before
