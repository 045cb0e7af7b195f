"""The prefix index's pure parts: a worker's changes netted, hashes as Redis stores them."""

from __future__ import annotations

from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.prefix_index import field, net_changes


def test_the_last_event_per_block_wins():
    events = [CacheChange("stored", 1), CacheChange("stored", 2), CacheChange("evicted", 1), CacheChange("evicted", 3),
              CacheChange("stored", 3)]
    assert net_changes(events) == ([2, 3], [1])


def test_hashes_are_stored_as_signed_64_bit_integers():
    assert field(5) == 5 and field((1 << 64) - 1) == -1 and field(1 << 63) == -(1 << 63)
