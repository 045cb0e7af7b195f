"""Work a router sent to each worker lately, which the worker's registry entry may not show yet.

Entries count for `horizon_s` (long enough for the worker to have taken the work and reported
it in a heartbeat). Adding, cancelling and reading the totals cost O(1) per entry over its
life, whatever the request rate: the totals are kept, not summed on each read.
"""

from __future__ import annotations

from collections import deque


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
