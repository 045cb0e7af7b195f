"""Which decode workers of a prefill worker's jobs are gone (their jobs are then given up:
compute and KV lease, instead of holding blocks until the lease ends).

One look per heartbeat at all of them: one round trip to the registry, and for each one
missing there a question on the bus (`off_bus`: whether the NATS server says "no responders"
on its subject, as it does for a killed process's at once). A worker is gone once it has
been missing from both for `absent_s` (`Absence.judge`, as the decode side's PrefillWatch in
pdserve/services/decode/watch.py judges prefill workers). Redis unreachable: no verdict.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from pdserve.shared.absence import Absence
from pdserve.shared.state.registry import Registry

log = logging.getLogger("prefill.watch")


class DecodeWatch:
    def __init__(self, registry: Registry, absent_s: float, off_bus: Callable[[str], Awaitable[bool]]):
        self.registry, self.off_bus = registry, off_bus
        self.absence = Absence(absent_s)

    async def look(self, targets: set[str]) -> set[str]:
        """The workers among `targets` that are gone, after one more look at them."""
        for who in set(self.absence.since) - targets:
            self.absence.forget(who)
        if not targets:
            return set()
        try:
            present = await self.registry.present(sorted(targets))
        except Exception as e:  # noqa: BLE001 - Redis away: no verdict
            log.debug("decode workers not looked at: %s", e)
            return set()
        missing = sorted(targets - present)
        off = await asyncio.gather(*(self.off_bus(w) for w in missing))
        return self.absence.judge(targets, present, {w for w, o in zip(missing, off) if o}, time.monotonic())
