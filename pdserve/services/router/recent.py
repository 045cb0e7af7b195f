"""Work a router sent to each worker lately, which the worker's registry entry may not show yet.

Entries count for `horizon_s` (long enough for the worker to have taken the work and reported
it in a heartbeat). Adding, cancelling and reading the totals cost O(1) per entry over its
life, whatever the request rate: the totals are kept, not summed on each read.
"""

from __future__ import annotations

from collections import deque

REGISTRY_READ_S = 0.2  # how often a router re-reads the registry


def horizons(heartbeat_s: float) -> tuple[float, float]:
    """How long booked work counts: (prefill tokens sent — the job pulled, then a heartbeat:
    two heartbeats and a second; requests admitted — in the decode worker's next heartbeat,
    then the router's next registry read, and a margin)."""
    return 2 * heartbeat_s + 1.0, heartbeat_s + REGISTRY_READ_S + 0.3


class Recent:
    def __init__(self, horizon_s: float):
        self.horizon_s = horizon_s
        self.entries: deque[list] = deque()  # [when, worker, amount], oldest first
        self.totals_now: dict[str, int] = {}

    def add(self, worker: str, amount: int, now: float) -> list:
        """Book `amount` on `worker`; returns the entry (to `cancel` it)."""
        entry = [now, worker, amount]
        self.entries.append(entry)
        self.totals_now[worker] = self.totals_now.get(worker, 0) + amount
        return entry

    def cancel(self, entry: list) -> None:
        """The work did not go there after all (its admit was refused)."""
        self._drop(entry)

    def totals(self, now: float) -> dict[str, int]:
        """Per worker, the work booked within the horizon (the router's own dict: read, not kept)."""
        while self.entries and self.entries[0][0] <= now - self.horizon_s:
            self._drop(self.entries.popleft())
        return self.totals_now

    def _drop(self, entry: list) -> None:
        _, worker, amount = entry
        if amount:  # not dropped before (an entry may expire before its admit is refused)
            entry[2] = 0
            self.totals_now[worker] -= amount
            if not self.totals_now[worker]:
                del self.totals_now[worker]
