import hashlib

from pdserve.shared.hashing import ROOT_HASH, block_hash, block_hashes


def test_chained_hash_depends_on_the_whole_prefix():
    a = block_hashes(list(range(48)), 16)
    b = block_hashes([99] + list(range(1, 48)), 16)
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b))  # first block differs, so every later hash does
    assert a[1] == block_hash(a[0], list(range(16, 32)))
    assert a[0] == block_hash(ROOT_HASH, list(range(16)))


def test_partial_block_has_no_hash_and_hash_is_stable():
    assert block_hashes(list(range(15)), 16) == []
    assert block_hashes(list(range(40)), 16) == block_hashes(list(range(32)), 16)
    # a fixed value: the hash must never change between processes or releases; it is BLAKE2b-64's
    assert block_hash(ROOT_HASH, [1, 2, 3]) == block_hash(0, (1, 2, 3)) == 9844765247879724409
    reference = hashlib.blake2b(bytes(8) + bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]), digest_size=8,
                                person=b"pdserve-kv-block").digest()
    assert block_hash(0, [1, 2, 3]) == int.from_bytes(reference, "little")
    assert isinstance(block_hash(0, [1]), int) and block_hash(0, [1]) != block_hash(0, [2])
