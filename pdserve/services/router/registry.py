"""A router's copy of the worker registry, kept by reading only what changed.

Every heartbeat and departure is numbered in Redis (pdserve/shared/state/registry.py: `pd:{registry}:seq`, and
`pd:{registry}:changes`, each worker id scored by its latest change). A read asks for the
changes after the last number seen: ~W x read period / heartbeat period entries, not W, so
neither Redis nor the router spends time on workers that did not beat since. Each entry
carries what was left of its lease when read; one that is not renewed by then lapses here,
as its key lapses in Redis. A first read, or a Redis that restarted empty (a new epoch),
reads everything.

An entry is its worker's own word: one that cannot be read, or names another worker, is
skipped (pdserve/shared/state/registry.py); capacity past `Bounds` is taken as the bound.

Lifecycle: made empty; `read(state)` every REGISTRY_READ_S (pdserve/services/router/main.py);
`workers()` between reads.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.shared import metrics
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.state import State

log = logging.getLogger("router.registry")


@dataclass(frozen=True)
class Bounds:
    """What a worker's entry may claim: an entry is its worker's own word, and a bigger claim
    (more free blocks, a faster prefill, a shorter queue) draws traffic, and the prompts with
    it, to that worker. Counts are taken as at least 0, free blocks as at most the total, the
    total and the prefill rate as at most these."""

    max_blocks: int = 1 << 20
    max_tokens_per_s: float = 1e6

    def of(self, info: WorkerInfo) -> WorkerInfo:
        total = min(max(info.total_blocks, 0), self.max_blocks)
        rate = info.prefill_tokens_per_s if math.isfinite(info.prefill_tokens_per_s) else 0.0
        fair = {"total_blocks": total, "free_blocks": min(max(info.free_blocks, 0), total),
                "growth_blocks": max(info.growth_blocks, 0), "running": max(info.running, 0),
                "waiting": max(info.waiting, 0), "queued_tokens": max(info.queued_tokens, 0),
                "prefill_tokens_per_s": min(max(rate, 0.0), self.max_tokens_per_s)}
        over = {k: v for k, v in fair.items() if getattr(info, k) != v}
        if not over:
            return info
        metrics.CLAMPED_REGISTRY_ENTRIES.inc()
        log.warning("registry entry of %s over the bounds: %s taken as %s", info.worker_id,
                    {k: getattr(info, k) for k in over}, over)
        return info.model_copy(update=over)


class RegistryCopy:
    def __init__(self, clock: Callable[[], float] = time.monotonic, bounds: Bounds = Bounds()) -> None:
        self.clock, self.bounds = clock, bounds
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
                self.entries[worker_id] = (self.bounds.of(info), asked + lease_left_s)
        self.epoch, self.seq = changes.epoch, changes.seq
        self.changes_read += len(changes.entries)

    def workers(self) -> list[WorkerInfo]:
        """The workers whose lease holds, by id."""
        now = self.clock()
        lapsed = [w for w, (_, until) in self.entries.items() if until <= now]
        for worker_id in lapsed:
            del self.entries[worker_id]
        return sorted((info for info, _ in self.entries.values()), key=lambda w: w.worker_id)
