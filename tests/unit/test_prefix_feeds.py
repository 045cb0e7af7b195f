"""Each worker's feed into the memory index (pdserve/services/router/prefix_feeds.py) and the messages
a worker sends (pdserve/shared/prefix_events.py): applied in order, a gap or a new life answered by a
snapshot with the events since on top, and the index equal to the worker's cache whatever the
point the snapshot is taken at."""

from __future__ import annotations

import random

from pdserve.services.router.prefix_feeds import MAX_BUFFERED, Feeds, Snapshot
from pdserve.services.router.prefix_memory import MemoryIndex
from pdserve.shared import prefix_events
from pdserve.shared.engine.block_manager import CacheChange
from pdserve.shared.messages import PrefixEvents, WorkerInfo


def ev(first: int, last: int, added=(), removed=(), epoch: str = "e1", worker: str = "w") -> PrefixEvents:
    return PrefixEvents(worker_id=worker, epoch=epoch, first=first, last=last, added=list(added),
                        removed=list(removed))


def held(feeds: Feeds, worker: str = "w") -> set[int]:
    holder = feeds.feeds[worker].holder
    return feeds.index.held(holder) if holder is not None else set()


def test_a_worker_first_heard_is_snapshotted_and_the_events_meanwhile_land_on_top():
    feeds = Feeds(MemoryIndex(), gone_s=3)
    assert feeds.on_events(ev(4, 6, added=[7])) is True          # not followed yet: its snapshot
    assert feeds.on_events(ev(6, 7, removed=[1])) is False       # held while it is awaited
    assert feeds.awaiting() == ["w"]
    assert feeds.on_snapshot(Snapshot("w", "e1", 5, [1, 2, 3])) is False  # (4, 6] overlaps: re-stated
    assert held(feeds) == {2, 3, 7} and feeds.feeds["w"].seq == 7 and feeds.awaiting() == []
    assert feeds.on_events(ev(7, 8, added=[9])) is False and 9 in held(feeds)
    assert feeds.on_events(ev(5, 8, added=[1])) is False and 1 not in held(feeds)  # counted already: skipped


def test_a_gap_keeps_the_entries_until_the_snapshot_and_asks_again_if_one_follows_it():
    feeds = Feeds(MemoryIndex(), gone_s=3)
    feeds.on_events(ev(0, 1, added=[1]))
    feeds.on_snapshot(Snapshot("w", "e1", 1, [1]))
    assert feeds.on_events(ev(3, 4, added=[4])) is True          # changes 2-3 lost
    assert feeds.index.lookup([1]) == {"w": 1}                   # still counted meanwhile
    feeds.on_events(ev(6, 7, added=[7]))                         # and another hole after the snapshot
    assert feeds.on_snapshot(Snapshot("w", "e1", 5, [1, 2, 4])) is True
    assert feeds.awaiting() == ["w"] and held(feeds) == {1, 2, 4}
    assert feeds.on_snapshot(Snapshot("w", "e1", 7, [1, 2, 4, 7])) is False and held(feeds) == {1, 2, 4, 7}


def test_a_new_life_drops_the_old_entries_at_once_and_a_late_word_of_the_old_is_ignored():
    feeds = Feeds(MemoryIndex(), gone_s=3)
    feeds.on_events(ev(0, 1, added=[1]))
    feeds.on_snapshot(Snapshot("w", "e1", 1, [1]))
    assert feeds.on_events(ev(0, 1, added=[5], epoch="e2")) is True
    assert feeds.index.lookup([1]) == {}                         # the restarted cache is empty
    feeds.on_snapshot(Snapshot("w", "e2", 1, [5]))
    assert feeds.on_events(ev(1, 2, added=[6])) is False         # e1, late: nothing
    assert held(feeds) == {5} and feeds.feeds["w"].epoch == "e2"


def test_the_registry_names_new_lives_and_drops_workers_gone():
    feeds = Feeds(MemoryIndex(), gone_s=3)
    workers = [WorkerInfo(worker_id="w", role="decode", prefix_epoch="e1"),
               WorkerInfo(worker_id="old", role="prefill"),            # publishes no events: not followed
               WorkerInfo(worker_id="r", role="router", prefix_epoch="x")]
    assert feeds.registry(workers, now=0) == ["w"]
    assert feeds.registry(workers, now=0.2) == []                    # already awaited
    feeds.on_snapshot(Snapshot("w", "e1", 0, [1]))
    assert feeds.registry(workers, now=0.4) == []
    restarted = [WorkerInfo(worker_id="w", role="decode", prefix_epoch="e2")]
    assert feeds.registry(restarted, now=0.6) == ["w"] and feeds.index.lookup([1]) == {}
    feeds.on_snapshot(Snapshot("w", "e2", 0, [2]))
    assert feeds.registry(workers, now=0.8) == []                     # an older copy of the registry: e1 seen
    feeds.registry([], now=1.0)
    assert "w" in feeds.feeds
    feeds.registry([], now=4.0)
    assert feeds.feeds == {} and feeds.index.lookup([2]) == {}


def test_held_events_are_bounded_and_a_snapshot_after_losing_some_asks_again():
    feeds = Feeds(MemoryIndex(), gone_s=3)
    feeds.on_events(ev(0, 1))
    for n in range(1, MAX_BUFFERED + 10):
        feeds.on_events(ev(n, n + 1, added=[n]))
    assert len(feeds.feeds["w"].buffered or []) == MAX_BUFFERED
    assert feeds.on_snapshot(Snapshot("w", "e1", 2, [1, 2])) is True  # events past MAX_BUFFERED lost: a gap


def test_the_index_equals_the_cache_wherever_the_snapshot_falls():
    """A worker's cache under random changes, drained in batches (and published in messages of
    a few batches); the snapshot taken between any two steps, with changes not drained yet in it;
    some messages lost. The index ends equal to the cache."""
    rng = random.Random(3)
    for trial in range(200):
        cache: set[int] = set()
        undrained: list[CacheChange] = []
        drained, sent, queued = 0, 0, []
        feeds = Feeds(MemoryIndex(), gone_s=3)
        snapshot_at, lose_at = rng.randint(0, 30), rng.choice([None, rng.randint(0, 30)])
        for step in range(40):
            for _ in range(rng.randint(0, 6)):                      # the engine changes its cache
                h = rng.randint(0, 15)
                kind = "evicted" if h in cache else "stored"
                (cache.discard if kind == "evicted" else cache.add)(h)
                undrained.append(CacheChange(kind, h))
            if step == snapshot_at:                                  # taken between steps, on the engine thread
                snap = Snapshot("w", "e", drained, sorted(cache))
            queued += undrained                                      # drained at the step's end
            drained, undrained = drained + len(undrained), []
            if rng.random() < 0.5 or step == 39:                     # the publisher's task sends what queued
                for msg in prefix_events.messages("w", "e", sent, queued):
                    if step != lose_at and feeds.on_events(msg) and step >= snapshot_at:
                        feeds.on_snapshot(Snapshot("w", "e", drained, sorted(cache)))
                sent, queued = drained, []
            if step == snapshot_at and feeds.awaiting():
                feeds.on_snapshot(snap)
        if feeds.awaiting():
            feeds.on_snapshot(Snapshot("w", "e", drained, sorted(cache)))
        assert held(feeds) == cache, trial


def test_a_registry_entry_ahead_of_the_events_for_a_while_calls_for_a_snapshot():
    """The last events were lost (none follows to show the gap): the heartbeat's count shows it."""
    feeds = Feeds(MemoryIndex(), gone_s=30, behind_s=2)
    feeds.on_events(ev(0, 1, added=[1]))
    feeds.on_snapshot(Snapshot("w", "e1", 1, [1]))

    def entry(seq: int) -> list[WorkerInfo]:
        return [WorkerInfo(worker_id="w", role="prefill", prefix_epoch="e1", prefix_seq=seq)]
    assert feeds.registry(entry(1), now=0) == []
    assert feeds.registry(entry(3), now=1) == [] and feeds.registry(entry(3), now=2) == []  # events may be on their way
    feeds.on_events(ev(1, 3, added=[2]))                                 # they were
    assert feeds.registry(entry(3), now=4) == []
    assert feeds.registry(entry(5), now=5) == [] and feeds.registry(entry(5), now=7) == ["w"]
    assert feeds.index.lookup([1, 2]) == {"w": 2}                       # counted until the snapshot lands
