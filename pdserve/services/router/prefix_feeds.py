"""Each worker's feed into the router's memory index (prefix_memory.py): which life of its
cache is indexed, up to which change, and when a snapshot of it is needed. Pure: the follower
(prefix_follower.py) hands in what arrives and asks for the snapshots named.

Per worker: its epoch (a life of its publisher, pdserve/shared/prefix_events.py), the changes counted
so far (`seq`) and its holder in the index. An event extending what is indexed (`first` <= seq
< `last`; netted changes re-state what they touch, so an overlap is harmless) is applied; one
already counted is skipped. A gap (`first` > seq), a new epoch or a worker not followed yet
calls for a snapshot: the events arriving meanwhile are buffered, then applied on top of it in
order (another gap: another snapshot). On a new epoch the old life's entries stop counting at
once (its cache is gone); on a gap they count until the snapshot replaces them. The registry
closes what no later event would show: a worker absent from it for `gone_s` is dropped; one
whose entry names an epoch not seen yet (a restart with no change since), or a count of changes
ahead of the events applied for `behind_s` (its last events lost), is asked for its snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.services.router.prefix_memory import MemoryIndex
from pdserve.shared.absence import Absence
from pdserve.shared.messages import PrefixEvents, WorkerInfo

BEHIND_S = 2.0    # a registry entry further on than the events applied for this long: a snapshot
MAX_BUFFERED = 4096   # events buffered per worker while its snapshot is awaited; beyond, dropped (another snapshot)


@dataclass
class Feed:
    epoch: str = ""
    seq: int = 0
    holder: int | None = None                    # its entries in the index (None: none)
    buffered: list[PrefixEvents] | None = None       # awaiting a snapshot: the events since (None: not awaiting)
    epochs: set[str] = field(default_factory=set)  # lives seen: a late event of a past one is ignored
    overflow: bool = False                       # events were dropped while buffered: the snapshot is not enough
    behind_since: float | None = None            # when its registry entry was first seen ahead of `seq`


@dataclass(frozen=True)
class Snapshot:
    worker_id: str
    epoch: str
    seq: int
    hashes: list[int]


class Feeds:
    def __init__(self, index: MemoryIndex, gone_s: float, behind_s: float = BEHIND_S):
        self.index, self.behind_s = index, behind_s
        self.feeds: dict[str, Feed] = {}
        self.absence = Absence(gone_s)
        self.applied = self.snapshots = 0   # events applied, snapshots taken in (counters)

    def on_events(self, ev: PrefixEvents) -> bool:
        """Apply or hold `ev`; True when its worker's snapshot is needed now (not already awaited)."""
        f = self.feeds.setdefault(ev.worker_id, Feed())
        if ev.epoch != f.epoch and ev.epoch in f.epochs:
            return False  # a past life's late word
        if f.buffered is not None:
            if len(f.buffered) < MAX_BUFFERED:
                f.buffered.append(ev)
            else:
                f.overflow = True
            return False
        if ev.epoch == f.epoch and f.holder is not None and ev.first <= f.seq:
            if ev.last > f.seq:
                self.index.apply(f.holder, ev.added, ev.removed)
                f.seq = ev.last
                self.applied += 1
            return False
        if ev.epoch != f.epoch:  # a new life: the old one's entries are wrong now
            self._retire(f)
            f.epoch = ev.epoch
            f.epochs.add(ev.epoch)
        f.buffered = [ev]
        return True

    def on_snapshot(self, snap: Snapshot) -> bool:
        """Index the worker's whole cache, then the events buffered since; True when another
        snapshot is needed (a gap after it, or a newer life)."""
        f = self.feeds.get(snap.worker_id)
        if f is None:  # dropped meanwhile (gone from the registry)
            return False
        self._retire(f)
        f.holder = self.index.holder(snap.worker_id)
        self.index.apply(f.holder, snap.hashes, [])
        f.epoch, f.seq = snap.epoch, snap.seq
        f.epochs.add(snap.epoch)
        buffered, f.buffered = f.buffered or [], None
        again, f.overflow = f.overflow, False
        self.snapshots += 1
        for ev in buffered:
            again = self.on_events(ev) or again
        return again

    def awaiting(self) -> list[str]:
        """The workers whose snapshot is needed."""
        return [w for w, f in self.feeds.items() if f.buffered is not None]

    def registry(self, workers: Iterable[WorkerInfo], now: float) -> list[str]:
        """One look at the registry: workers gone for `gone_s` dropped; those publishing events
        (an epoch in their entry) whose snapshot is needed returned (`_behind`)."""
        present = {w.worker_id: w for w in workers if w.role in ("prefill", "decode")}
        for worker_id in [w for w in self.feeds if w not in present]:
            if self.absence.gone(worker_id, False, now):
                self.drop(worker_id)
        for worker_id in present:
            self.absence.gone(worker_id, True, now)
        return [w.worker_id for w in present.values() if w.prefix_epoch and self._behind(w, now)]

    def _behind(self, w: WorkerInfo, now: float) -> bool:
        """Whether `w`'s snapshot is needed now: not followed yet, in a life not seen yet (its old
        entries are dropped at once), or further on in its changes than the events applied for
        `behind_s` (the last ones were lost: no later event shows the gap)."""
        f = self.feeds.get(w.worker_id)
        if f is not None and f.buffered is not None:
            return False  # awaited already
        if f is not None and w.prefix_epoch in f.epochs:
            if w.prefix_epoch != f.epoch or w.prefix_seq <= f.seq:  # an older copy of the entry, or caught up
                f.behind_since = None
                return False
            f.behind_since = now if f.behind_since is None else f.behind_since
            if now - f.behind_since < self.behind_s:
                return False
        else:
            f = self.feeds.setdefault(w.worker_id, Feed())
            self._retire(f)
        f.buffered, f.behind_since = [], None
        return True

    def drop(self, worker_id: str) -> None:
        f = self.feeds.pop(worker_id, None)
        self.absence.forget(worker_id)
        if f is not None:
            self._retire(f)

    def _retire(self, f: Feed) -> None:
        if f.holder is not None:
            self.index.retire(f.holder)
            f.holder = None
