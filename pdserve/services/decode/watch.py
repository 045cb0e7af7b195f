"""The prefill workers a decode worker's KV waits are waiting on, looked at together (the
mirror of pdserve/services/prefill/watch.py): one gone — its lease lapsed and no connection to the bus,
for `absent_s`: killed — is PrefillWorkerLost; the wait that finds one frozen or far behind is
PrefillWorkerLate (handoff.py's `wait_kv` decides that from the entries read here)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from pdserve.shared.absence import Absence
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.state.registry import Registry

log = logging.getLogger("decode.handoff")


class PrefillWorkerLost(RuntimeError):
    """The worker computing a request's KV is gone (missing from the registry and the bus), or
    a payload from it broke off in the transport, while the request waited for it."""


class PrefillWorkerLate(RuntimeError):
    """The request's KV did not come by its deadline, though its prefill worker holds its
    lease (frozen, or far behind its predicted time)."""


class PrefillWatch:
    """The registry entries of the prefill workers that KV waits are waiting on: one round
    trip per heartbeat for all of them (sooner while a missing one awaits confirmation),
    however many waits there are. A worker missing from the registry is asked on the bus
    (`off_bus`: the NATS server closes a killed process's connection at once); it is gone
    once it has been missing from both for `absent_s`. Either alone is no verdict: a Redis
    restarted empty shows everyone missing until their next heartbeat, and after a NATS
    restart workers reconnect one by one. Redis unreachable: no verdict either."""

    def __init__(self, registry: Registry, period_s: float, absent_s: float,
                 off_bus: Callable[[str], Awaitable[bool]] | None = None):
        self.registry, self.period_s, self.off_bus = registry, period_s, off_bus
        self.absence = Absence(absent_s)
        self.entries: dict[str, WorkerInfo] = {}   # the last entry found of each worker waited on
        self.gone: set[str] = set()

    async def watch(self, waited_on: Callable[[], set[str]]) -> None:
        while True:
            try:
                await self.look(waited_on())
            except Exception as e:  # noqa: BLE001 - never the end of the watch: the next look tries again
                log.warning("prefill workers not looked at: %s", e)
            await asyncio.sleep(self.next_look_s(time.monotonic()))

    async def look(self, workers: set[str]) -> None:
        for who in set(self.absence.since) - workers:
            self.absence.forget(who)
        if not workers:
            self.entries, self.gone = {}, set()
            return
        try:
            found = await self.registry.entries(sorted(workers))
        except Exception as e:  # noqa: BLE001 - Redis away: no verdict (no step to judge a freeze by)
            log.debug("prefill workers not looked at: %s", e)
            self.entries = {}
            return
        self.entries = {w: e for w, e in found.items() if e is not None}
        missing = sorted(workers - set(self.entries))
        off = await asyncio.gather(*(self.off_bus(w) for w in missing)) if self.off_bus else [True] * len(missing)
        self.gone = self.absence.judge(workers, set(self.entries), {w for w, o in zip(missing, off) if o},
                                       time.monotonic())

    def next_look_s(self, now: float) -> float:
        """A heartbeat, or less when a missing worker's absence is confirmed before then."""
        due = [since + self.absence.confirm_s - now for w, since in self.absence.since.items() if w not in self.gone]
        return max(0.05, min([self.period_s, *due]))
