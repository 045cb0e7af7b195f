"""Which decode workers of a prefill worker's jobs are gone (their jobs are then given up:
compute and KV lease, instead of holding blocks until the lease ends).

One look per heartbeat at all of them: one round trip to the registry, and for each one
missing there a question on the bus (`on_bus`: whether anything answers on its subject; the
NATS server says "no responders" for a killed process's at once). A worker is gone once it
has been missing from both for `absent_s` (shared/absence.py). Either alone is no verdict: a
Redis restarted empty shows every worker missing until its next heartbeat, and after a NATS
restart workers reconnect one by one. Redis unreachable: no verdict at all. The decode side's
watch of prefill workers (services/decode/handoff.py, PrefillWatch) judges the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from shared.absence import Absence
from shared.state import State

log = logging.getLogger("prefill.watch")


class DecodeWatch:
    def __init__(self, state: State, absent_s: float, on_bus: Callable[[str], Awaitable[bool | None]]):
        self.state, self.on_bus = state, on_bus
        self.absence = Absence(absent_s)

    async def look(self, targets: set[str]) -> set[str]:
        """The workers among `targets` that are gone, after one more look at them."""
        for who in set(self.absence.since) - targets:
            self.absence.forget(who)
        if not targets:
            return set()
        try:
            present = await self.state.present(sorted(targets))
        except Exception as e:  # noqa: BLE001 - Redis away: no verdict
            log.debug("decode workers not looked at: %s", e)
            return set()
        missing = sorted(targets - present)
        heard = await asyncio.gather(*(self.on_bus(w) for w in missing))
        present = present | {w for w, answered in zip(missing, heard) if answered is not False}
        now = time.monotonic()
        return {w for w in sorted(targets) if self.absence.gone(w, w in present, now)}
