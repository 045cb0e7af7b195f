"""A router's copy of the worker registry, kept by reading only what changed.

Every heartbeat and departure is numbered in Redis (shared/state/registry.py: `pd:{registry}:seq`, and
`pd:{registry}:changes`, each worker id scored by its latest change). A read asks for the
changes after the last number seen: ~W x read period / heartbeat period entries, not W, so
neither Redis nor the router spends time on workers that did not beat since. Each entry
carries what was left of its lease when read; one that is not renewed by then lapses here,
as its key lapses in Redis. A first read, or a Redis that restarted empty (a new epoch),
reads everything.

Lifecycle: made empty; `read(state)` every REGISTRY_READ_S (services/router/main.py);
`workers()` between reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.messages import WorkerInfo
from shared.state import State


class Registry:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.epoch, self.seq = "", 0
        self.entries: dict[str, tuple[WorkerInfo, float]] = {}  # id -> (entry, when its lease lapses here)
        self.changes_read = 0                                   # entries read so far (for the tests' count)

    async def read(self, state: State) -> None:
        """Apply the changes since the last read."""
        asked = self.clock()
        changes = await state.registry.changes(self.epoch, self.seq)
        if changes.full:
            self.entries = {}
        for worker_id, info, lease_left_s in changes.entries:
            if info is None:
                self.entries.pop(worker_id, None)
            else:  # the lease counted from when it was asked for: never later than Redis's
                self.entries[worker_id] = (info, asked + lease_left_s)
        self.epoch, self.seq = changes.epoch, changes.seq
        self.changes_read += len(changes.entries)

    def workers(self) -> list[WorkerInfo]:
        """The workers whose lease holds, by id."""
        now = self.clock()
        lapsed = [w for w, (_, until) in self.entries.items() if until <= now]
        for worker_id in lapsed:
            del self.entries[worker_id]
        return sorted((info for info, _ in self.entries.values()), key=lambda w: w.worker_id)
