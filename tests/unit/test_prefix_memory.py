"""The router's memory index (pdserve/services/router/prefix_memory.py): the Redis lookup's answer
(leading blocks per holder) for random fleets, holders retired at once and swept in steps."""

from __future__ import annotations

import random

from pdserve.services.router.prefix_memory import MemoryIndex, bits


def leading(caches: dict[str, set[int]], hashes: list[int]) -> dict[str, int]:
    """The reference: each worker's count of leading blocks of `hashes` it holds (none: absent)."""
    out = {}
    for w, cache in caches.items():
        n = 0
        while n < len(hashes) and hashes[n] in cache:
            n += 1
        if n:
            out[w] = n
    return out


def fleet(rng: random.Random, workers: int) -> tuple[dict[str, set[int]], list[list[int]]]:
    """Caches of prefixes of a few chains (shared starts, holes where a block was evicted)."""
    chains = [[rng.getrandbits(64) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    caches: dict[str, set[int]] = {}
    for i in range(workers):
        cache = set()
        for chain in rng.sample(chains, rng.randint(0, 4)):
            cache.update(chain[:rng.randint(0, len(chain))])
        if cache and rng.random() < 0.3:
            cache.discard(rng.choice(sorted(cache)))
        caches[f"w{i}"] = cache
    return caches, chains


def test_the_holders_of_a_shared_prefix_count_up_to_their_first_missing_block():
    index = MemoryIndex()
    for w, cache in {"a": [1, 2, 3, 4, 5], "b": [1, 2, 3], "c": [1, 2, 3, 5]}.items():
        index.apply(index.holder(w), cache, [])
    assert index.lookup([1, 2, 3, 4, 5, 6]) == {"a": 5, "b": 3, "c": 3}
    assert index.lookup([9, 1, 2]) == {} and index.lookup([]) == {}


def test_random_fleets_get_the_reference_answer_through_changes_retirements_and_sweeps():
    rng = random.Random(7)
    for _ in range(60):
        caches, chains = fleet(rng, rng.randint(1, 70))
        index, holders = MemoryIndex(), {}
        for w, cache in caches.items():
            holders[w] = index.holder(w)
            index.apply(holders[w], sorted(cache), [])
        for w in rng.sample(sorted(caches), len(caches) // 3):  # some change, some leave, some start anew
            if rng.random() < 0.5:
                removed = set(rng.sample(sorted(caches[w]), len(caches[w]) // 2))
                added = set(rng.choice(chains)[:3])
                index.apply(holders[w], sorted(added - removed), sorted(removed - added))
                caches[w] = (caches[w] - removed) | added
            else:
                index.retire(holders.pop(w))
                if rng.random() < 0.5:
                    del caches[w]
                else:
                    caches[w] = set(rng.choice(chains)[:rng.randint(1, 5)])
                    holders[w] = index.holder(w)
                    index.apply(holders[w], sorted(caches[w]), [])
            index.sweep(rng.randint(1, 20))
        for _ in range(20):
            chain = rng.choice(chains)
            prompt = chain[:rng.randint(0, len(chain))] + [rng.getrandbits(64) for _ in range(rng.randint(0, 3))]
            assert index.lookup(prompt) == leading(caches, prompt)
        assert {index.owners[k]: index.held(k) for k in index.owners} == caches
        assert all(index.sizes[k] == len(caches[w]) for w, k in holders.items())


def test_a_retired_holder_counts_no_more_and_its_number_is_free_once_swept():
    index = MemoryIndex()
    a, b = index.holder("a"), index.holder("b")
    index.apply(a, [1, 2, 3], [])
    index.apply(b, [1, 2], [])
    index.retire(a)
    assert index.lookup([1, 2, 3]) == {"b": 2} and len(index) == 3   # its bits stay until swept
    c = index.holder("c")
    assert c not in (a, b)                                           # not reused before the sweep
    steps = 0
    while index.dead:
        index.sweep(1)
        steps += 1
    assert steps == 3 and len(index) == 2 and index.blocks == {1: 1 << b, 2: 1 << b}
    assert index.holder("d") == a                                    # swept clean: taken again
    assert bits(0b10110) == [1, 2, 4]


def test_a_holder_adding_a_block_twice_or_removing_one_it_lacks_changes_nothing():
    index = MemoryIndex()
    a, b = index.holder("a"), index.holder("b")
    index.apply(a, [1, 2, 2], [])
    index.apply(b, [2], [1, 3])
    index.apply(a, [1], [7])
    assert index.sizes == {a: 2, b: 1} and index.blocks == {1: 1 << a, 2: (1 << a) | (1 << b)}
