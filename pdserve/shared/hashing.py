"""Chained content hashes of full KV blocks: `h_i = H(h_{i-1}, tokens of block i)`, from a
root that is 0, or the hash of the request's cache salt (`root_hash`): requests with different
salts share no block, so one tenant's prompts never serve, or reveal, another's.

The engine, the router's prefix index and the KV transfer all call this one function, so a
block hash means the same thing everywhere. H is BLAKE2b with an 8-byte digest over the parent
hash and the block's token ids as little-endian int32: stable across processes and machines
(never `hash()`), and a cryptographic hash, so making a block whose hash is another's costs
about 2^64 tries (with a non-cryptographic one, xxh3, it is arithmetic: one prompt could be
served another's cached KV). `make bench-security` measures it against xxh3.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH = 0  # parent of the first block
_PERSON = b"pdserve-kv-block"  # (BLAKE2b's personalization: these hashes are of nothing else)


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=_PERSON).digest(), "little")


def root_hash(cache_salt: str) -> int:
    """The parent of a request's first block: ROOT_HASH unsalted, else its salt's hash."""
    return _h(cache_salt.encode()) if cache_salt else ROOT_HASH


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    return _h(parent.to_bytes(8, "little") + np.asarray(tokens, dtype="<i4").tobytes())


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[int]:
    """Hashes of every full block of `token_ids`; a trailing partial block has none."""
    data, step = np.asarray(token_ids, dtype="<i4").tobytes(), 4 * block_size  # converted once, not per block
    out, parent = [], root_hash(cache_salt)
    for start in range(0, (len(token_ids) // block_size) * step, step):
        parent = _h(parent.to_bytes(8, "little") + data[start:start + step])
        out.append(parent)
    return out
