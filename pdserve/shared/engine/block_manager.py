"""Paged-KV block accounting: reference counts, content hashes, prefix reuse, LRU eviction.

A block is a fixed slot of `block_size` tokens in every layer's pool. A block that is full
and whose content is final gets a chained hash (pdserve/shared/hashing.py) and enters the prefix
index; when its last user lets go it stays there, reusable by a later prompt with the same
prefix, until the pool needs the space (least recently released goes first).

Every change to the prefix index is recorded as a CacheChange ("stored" / "evicted"); the owner
drains them with `drain_changes()` and publishes them for the router's prefix index.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Literal

from pdserve.shared.hashing import block_hashes


@dataclass(frozen=True)
class CacheChange:
    kind: Literal["stored", "evicted"]
    block_hash: int


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy an allocation (the caller decides: wait, preempt or refuse)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._plain: deque[int] = deque(range(num_blocks))  # free, no reusable content
        self._cached: OrderedDict[int, None] = OrderedDict()  # free, content reusable, LRU first
        self._changes: list[CacheChange] = []

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that an allocation may take (cached-but-unreferenced ones count)."""
        return len(self._plain) + len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, token_ids: list[int], cache_salt: str = "") -> list[int]:
        """Block ids holding the longest cached prefix of `token_ids` (full blocks only).

        Never the whole prompt: at least one token is left to compute, since the next token
        is sampled from its logits.
        """
        if not self.enable_prefix_cache:
            return []
        hashes = block_hashes(token_ids[:len(token_ids) - 1], self.block_size, cache_salt)
        hit = []
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, token_ids: list[int], num_tokens: int, cache_salt: str = "") -> tuple[list[int], int]:
        """Blocks for the first `num_tokens` slots of a sequence: (block table, cached tokens).

        Reuses the cached prefix of `token_ids` and takes fresh blocks for the rest, or
        raises OutOfBlocks and changes nothing.
        """
        hit = self.cached_prefix(token_ids, cache_salt)
        fresh = self.blocks_needed(num_tokens) - len(hit)
        reusable_free = sum(1 for b in hit if self.ref_count[b] == 0)
        if fresh > self.num_free - reusable_free:
            raise OutOfBlocks(f"need {fresh} blocks, {self.num_free - reusable_free} free")
        for b in hit:
            self._ref(b)
        return hit + [self._take() for _ in range(fresh)], len(hit) * self.block_size

    def append_slot(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` so that it holds `num_tokens` slots (decode adds one at a time)."""
        need = self.blocks_needed(num_tokens) - len(table)
        if need > self.num_free:
            raise OutOfBlocks(f"need {need} blocks, {self.num_free} free")
        table.extend(self._take() for _ in range(need))

    def commit_full_blocks(self, blocks: list[int], hashes: list[int]) -> None:
        """Enter full blocks whose content is final in the prefix index, with their hashes."""
        if not self.enable_prefix_cache:
            return
        for block, h in zip(blocks, hashes, strict=True):
            if self.block_hash[block] is not None or h in self.hash_to_block:
                continue  # already indexed, or the same content already lives in another block
            self.block_hash[block] = h
            self.hash_to_block[h] = block
            self._changes.append(CacheChange("stored", h))

    def free(self, table: list[int]) -> None:
        """Drop one reference to each block; tail blocks first so they are evicted first."""
        for block in reversed(table):
            self.ref_count[block] -= 1
            if self.ref_count[block] < 0:
                raise AssertionError(f"block {block} freed twice")
            if self.ref_count[block] == 0:
                if self.block_hash[block] is None:
                    self._plain.append(block)
                else:
                    self._cached[block] = None
        table.clear()

    def drain_changes(self) -> list[CacheChange]:
        changes, self._changes = self._changes, []
        return changes

    # -- internals -----------------------------------------------------------------------
    def _ref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self._cached.pop(block, None)
        self.ref_count[block] += 1

    def _take(self) -> int:
        if self._plain:
            block = self._plain.popleft()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            h = self.block_hash[block]
            assert h is not None  # a cached block has its hash
            del self.hash_to_block[h]
            self.block_hash[block] = None
            self._changes.append(CacheChange("evicted", h))
        else:
            raise OutOfBlocks("pool exhausted")
        self.ref_count[block] = 1
        return block
