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

    def judge(self, workers: set[str], registered: set[str], off_bus: set[str], now: float) -> set[str]:
        """One look at each of `workers`: those gone — missing from the registry (not in
        `registered`) and from the bus (in `off_bus`: the server said no responders) for
        `confirm_s`. Either alone is no verdict: a Redis restarted empty shows everyone missing
        until their next heartbeat, and after a NATS restart workers reconnect one by one."""
        return {w for w in sorted(workers) if self.gone(w, w in registered or w not in off_bus, now)}

    def forget(self, who: str) -> None:
        self.since.pop(who, None)
