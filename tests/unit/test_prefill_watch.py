"""pdserve/services/decode/watch.py's PrefillWatch: one look for all the KV waits, absence confirmed,
and gone only when missing from the registry and the bus alike."""

from __future__ import annotations

import asyncio
import time

from pdserve.services.decode.watch import PrefillWatch
from pdserve.shared.messages import WorkerInfo


class Registry:
    """state.registry.entries over a dict; counts round trips; `down` makes Redis unreachable."""

    def __init__(self, workers: set[str]):
        self.workers, self.calls, self.down = workers, 0, False

    async def entries(self, ids: list[str]) -> dict[str, WorkerInfo | None]:
        self.calls += 1
        if self.down:
            raise ConnectionError("redis away")
        return {w: WorkerInfo(worker_id=w, role="prefill", step_s=1.0) if w in self.workers else None for w in ids}


def test_one_look_for_all_waits_and_absence_confirmed_before_gone():
    async def go():
        registry = Registry({"p0", "p1"})
        watch = PrefillWatch(registry, period_s=1.0, absent_s=0.2)  # type: ignore[arg-type]
        await watch.look({"p0", "p1"})
        assert registry.calls == 1 and set(watch.entries) == {"p0", "p1"} and not watch.gone
        registry.workers.discard("p1")          # killed: its lease lapsed
        await watch.look({"p0", "p1"})
        assert "p1" not in watch.entries and not watch.gone  # one look is no verdict
        assert watch.next_look_s(time.monotonic()) <= 0.2  # looked at again sooner
        registry.down = True                    # Redis away: no verdict either way
        await asyncio.sleep(0.25)
        await watch.look({"p0", "p1"})
        assert not watch.gone and not watch.entries   # (no step to judge a freeze by either)
        registry.down = False
        await watch.look({"p0", "p1"})
        assert watch.gone == {"p1"}
        registry.workers.add("p1")              # back (restarted): present again
        await watch.look({"p0", "p1"})
        assert not watch.gone
        await watch.look(set())                 # nothing waited on: nothing looked at
        assert registry.calls == 5 and not watch.entries
    asyncio.run(go())


def test_missing_from_the_registry_but_on_the_bus_is_not_gone():
    """A Redis restarted empty: every entry missing until the next heartbeat, every worker
    still connected to the bus."""
    async def go():
        registry, connected = Registry(set()), {"p0"}

        async def off_bus(worker):
            return worker not in connected

        watch = PrefillWatch(registry, period_s=1.0, absent_s=0.1, off_bus=off_bus)  # type: ignore[arg-type]
        for _ in range(3):
            await watch.look({"p0", "p1"})
            await asyncio.sleep(0.06)
        assert watch.gone == {"p1"}   # p1 is off the bus too: killed
    asyncio.run(go())
