import pytest

from pdserve.shared.engine.block_manager import BlockManager, OutOfBlocks
from pdserve.shared.hashing import block_hashes


def make(n=8):
    return BlockManager(num_blocks=n, block_size=4)


def test_allocate_and_free_return_every_block():
    bm = make()
    table, cached = bm.allocate(list(range(10)), 10)
    assert len(table) == 3 and cached == 0 and bm.num_free == 5
    bm.free(table)
    assert bm.num_free == 8 and table == []


def test_prefix_hit_reuses_committed_blocks_and_refcounts():
    bm = make()
    prompt = list(range(12))
    a, _ = bm.allocate(prompt, 12)
    bm.commit_full_blocks(a, block_hashes(prompt, 4))
    events = bm.drain_changes()
    assert [e.kind for e in events] == ["stored"] * 3
    assert [e.block_hash for e in events] == block_hashes(prompt, 4)
    # a second prompt sharing 2 blocks: the whole-prompt hit is capped so one token is computed
    b, cached = bm.allocate(prompt[:8] + [50, 51, 52], 11)
    assert b[:2] == a[:2] and cached == 8 and bm.ref_count[a[0]] == 2
    c, cached = bm.allocate(prompt, 12)
    assert c[:2] == a[:2] and cached == 8  # block 3 would leave nothing to compute
    for t in (a, b, c):
        bm.free(t)
    assert bm.num_free == 8


def test_lru_eviction_emits_events_and_prefers_plain_blocks():
    bm = make(4)
    p = list(range(8))
    a, _ = bm.allocate(p, 8)
    bm.commit_full_blocks(a, block_hashes(p, 4))
    bm.drain_changes()
    bm.free(a)
    assert bm.num_free == 4
    x, _ = bm.allocate([100] * 8, 8)  # takes the 2 plain blocks first: cache intact
    assert bm.drain_changes() == [] and len(bm.hash_to_block) == 2
    y, _ = bm.allocate([200] * 4, 4)  # must evict: the tail block was released first
    ev = bm.drain_changes()
    assert [e.kind for e in ev] == ["evicted"] and ev[0].block_hash == block_hashes(p, 4)[1]
    bm.free(x)
    bm.free(y)
    assert bm.num_free == 4


def test_out_of_blocks_changes_nothing():
    bm = make(4)
    a, _ = bm.allocate(list(range(12)), 12)
    with pytest.raises(OutOfBlocks):
        bm.allocate(list(range(100, 108)), 8)
    assert bm.num_free == 1
    bm.append_slot(a, 13)
    with pytest.raises(OutOfBlocks):
        bm.append_slot(a, 17)
    bm.free(a)
    assert bm.num_free == 4


def test_double_free_is_caught():
    bm = make()
    a, _ = bm.allocate([1, 2, 3], 3)
    copy = list(a)
    bm.free(a)
    with pytest.raises(AssertionError):
        bm.free(copy)
