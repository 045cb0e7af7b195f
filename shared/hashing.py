"""Chained content hashes of full KV blocks: `h_i = H(h_{i-1}, tokens of block i)`, from a
root that is 0, or the hash of the request's cache salt (`root_hash`): requests with different
salts share no block, so one tenant's prompts never serve, or reveal, another's.

The engine, the router's prefix index and the KV transfer all call this one function, so a
block hash means the same thing everywhere. xxh3-64 over the parent hash and the block's
token ids as little-endian int32: stable across processes and machines (never `hash()`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

ROOT_HASH = 0  # parent of the first block


def root_hash(cache_salt: str) -> int:
    """The parent of a request's first block: ROOT_HASH unsalted, else its salt's hash."""
    return xxhash.xxh3_64_intdigest(cache_salt.encode()) if cache_salt else ROOT_HASH


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + np.asarray(tokens, dtype="<i4").tobytes())


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[int]:
    """Hashes of every full block of `token_ids`; a trailing partial block has none."""
    data, step = np.asarray(token_ids, dtype="<i4").tobytes(), 4 * block_size  # converted once, not per block
    out, parent = [], root_hash(cache_salt)
    for start in range(0, (len(token_ids) // block_size) * step, step):
        parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + data[start:start + step])
        out.append(parent)
    return out
