"""Whether a process is gone: absent from the registry for a while, not at one look.

A Redis that restarted empty shows every worker absent until its next heartbeat, so one look
that misses a worker is no verdict: it is gone once it has been missing for `confirm_s` (more
than a heartbeat). A look that finds it starts over. Pure: the caller looks and says when.
"""

from __future__ import annotations


class Absence:
    def __init__(self, confirm_s: float):
        self.confirm_s = confirm_s
        self.since: dict[str, float] = {}   # who was seen missing, since when (monotonic)

    def gone(self, who: str, present: bool, now: float) -> bool:
        """Note one look at `who` (`present`: found in the registry); True once it has been
        missing for `confirm_s`."""
        if present:
            self.since.pop(who, None)
            return False
        return now - self.since.setdefault(who, now) >= self.confirm_s

    def forget(self, who: str) -> None:
        self.since.pop(who, None)
