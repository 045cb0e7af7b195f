"""The prefix index in a router's memory (PD_PREFIX_INDEX=events): block hash -> its holders.

A *holder* is one life of one worker's cache as this router indexes it (a small number, reused
once free); each block maps to the holders holding it as a bitmask (holder k: bit k). Pure and
synchronous: prefix_feeds.py applies the workers' events and snapshots to it, placements look
prompts up in it (`lookup`, the Redis index's `_LOOKUP` answer by worker), nothing here waits.

A retired holder (its worker gone, restarted or resynced) stops counting at once (`alive`); its
bits are cleared from the blocks in the background by `sweep`, a bounded step at a time, after
which its number is free again. Its cost is ~70 bytes per indexed block (a dict entry and the
hash's int object; the bitmask of a block with one holder is shared), ~85 in the process's
growth at 10M blocks: bench/scale/index_compare.py.
"""

from __future__ import annotations


def bits(mask: int) -> list[int]:
    """The holder numbers in `mask`, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class MemoryIndex:
    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}   # block hash -> its holders' bits
        self.owners: dict[int, str] = {}   # live holder -> its worker
        self.sizes: dict[int, int] = {}    # live holder -> blocks it holds
        self.alive = 0                     # bits of the live holders
        self.dead = 0                      # bits of retired holders not swept yet
        self.free: list[int] = []          # holder numbers swept clean: taken first
        self.next = 0                      # numbers handed out so far
        self._bit: list[int] = []          # 1 << k, one object each (shared by the blocks it alone holds)
        self._pass: tuple[int, list[int], int] | None = None   # the sweep under way: (bits, hashes, cursor)

    def __len__(self) -> int:
        return len(self.blocks)

    def holder(self, worker_id: str) -> int:
        """A new, empty holder for a life of `worker_id`'s cache."""
        if self.free:
            k = self.free.pop()
        else:
            k, self.next = self.next, self.next + 1
            self._bit.append(1 << k)
        self.owners[k], self.sizes[k] = worker_id, 0
        self.alive |= self._bit[k]
        return k

    def retire(self, k: int) -> None:
        """`k` holds nothing from now (its bits go in the background: `sweep`)."""
        if self.owners.pop(k, None) is None:
            return
        del self.sizes[k]
        self.alive &= ~self._bit[k]
        self.dead |= self._bit[k]

    def apply(self, k: int, added: list[int], removed: list[int]) -> None:
        """Holder `k` now holds `added` and no longer holds `removed`."""
        blocks, bit, n = self.blocks, self._bit[k], 0
        get = blocks.get
        for h in added:
            old = get(h)
            if old is None:
                blocks[h] = bit
                n += 1
            elif not old & bit:
                blocks[h] = old | bit
                n += 1
        drop = ~(bit | self.dead)
        for h in removed:
            old = get(h)
            if old is not None and old & bit:
                n -= 1
                if rest := old & drop:
                    blocks[h] = rest
                else:
                    del blocks[h]
        self.sizes[k] += n

    def lookup(self, hashes: list[int]) -> dict[str, int]:
        """Worker -> how many leading blocks of `hashes` it holds (workers holding none absent):
        walks the blocks while some holder holds every block so far."""
        get, alive, out = self.blocks.get, self.alive, {}
        holders, prev, last = -1, -1, 0
        for i, h in enumerate(hashes):
            m = get(h)
            if m is None:
                break
            if m != prev:  # (a run of blocks held alike is not intersected again)
                prev = m
                now = m & alive if holders < 0 else holders & m
                for k in bits((holders & ~now) if holders > 0 else 0):
                    out[self.owners[k]] = i
                holders = now
                if not now:
                    break
            last = i + 1
        for k in bits(max(holders, 0)):
            out[self.owners[k]] = last
        return out

    def held(self, k: int) -> set[int]:
        """Every block holder `k` holds (a scan: for tests and checks, not placements)."""
        bit = self._bit[k]
        return {h for h, m in self.blocks.items() if m & bit}

    def sweep(self, budget: int) -> int:
        """One step of clearing retired holders' bits: up to `budget` blocks of a pass over every
        block indexed when it began (for the holders retired by then). Returns the blocks changed."""
        if self._pass is None:
            if not self.dead:
                return 0
            self._pass = (self.dead, list(self.blocks), 0)
        gone, hashes, at = self._pass
        blocks, keep, changed = self.blocks, ~gone, 0
        end = min(at + budget, len(hashes))
        for h in hashes[at:end]:
            m = blocks.get(h)
            if m is not None and m & gone:
                changed += 1
                if rest := m & keep:
                    blocks[h] = rest
                else:
                    del blocks[h]
        if end < len(hashes):
            self._pass = (gone, hashes, end)
        else:  # every block of the pass is clear of them: their numbers are free
            self._pass = None
            self.dead &= keep
            self.free.extend(bits(gone))
        return changed
