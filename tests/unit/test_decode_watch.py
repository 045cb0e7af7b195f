"""pdserve/services/prefill/watch.py's DecodeWatch: a decode worker is gone only when missing from
the registry and the bus alike, for `absent_s`; Redis away is no verdict."""

from __future__ import annotations

import asyncio

from pdserve.services.prefill.watch import DecodeWatch


class Registry:
    """state.registry.present over a set; counts round trips; `down` makes Redis unreachable."""

    def __init__(self, workers: set[str]):
        self.workers, self.calls, self.down = workers, 0, False

    async def present(self, ids: list[str]) -> set[str]:
        self.calls += 1
        if self.down:
            raise ConnectionError("redis away")
        return set(ids) & self.workers


def test_a_redis_restarted_empty_gives_up_no_live_decode_workers_job():
    async def go():
        registry, connected = Registry(set()), {"d0", "d1"}   # every entry gone, both still on the bus
        asked: list[str] = []

        async def off_bus(worker):
            asked.append(worker)
            return worker not in connected      # "no responders"

        watch = DecodeWatch(registry, absent_s=0.1, off_bus=off_bus)  # type: ignore[arg-type]
        for _ in range(3):
            assert await watch.look({"d0", "d1"}) == set()
            await asyncio.sleep(0.06)
        assert registry.calls == 3 and sorted(asked) == ["d0"] * 3 + ["d1"] * 3
        connected.discard("d1")               # killed: the server says no responders
        assert await watch.look({"d0", "d1"}) == set()    # one look is no verdict
        await asyncio.sleep(0.12)
        assert await watch.look({"d0", "d1"}) == {"d1"}
    asyncio.run(go())


def test_silence_on_the_bus_is_no_verdict_and_redis_away_judges_nothing():
    async def go():
        registry = Registry({"d0"})

        async def off_bus(worker):
            return False                      # a timeout: no verdict, not off

        watch = DecodeWatch(registry, absent_s=0.05, off_bus=off_bus)  # type: ignore[arg-type]
        registry.workers.clear()
        await watch.look({"d0"})
        await asyncio.sleep(0.06)
        assert await watch.look({"d0"}) == set()
        registry.down = True
        assert await watch.look({"d0"}) == set()
        assert await watch.look(set()) == set() and registry.calls == 3  # nothing in hand: no look
    asyncio.run(go())


def test_only_bus_absence_and_registry_absence_together_make_gone():
    async def go():
        registry = Registry(set())

        async def off_bus(worker):
            return True                       # no responders

        watch = DecodeWatch(registry, absent_s=0.05, off_bus=off_bus)  # type: ignore[arg-type]
        assert await watch.look({"d0"}) == set()
        await asyncio.sleep(0.06)
        assert await watch.look({"d0"}) == {"d0"}
        registry.workers.add("d0")            # back in the registry: present, whatever the bus says
        assert await watch.look({"d0"}) == set()
    asyncio.run(go())
