"""What a worker does after its NATS connection comes back: each side of an exchange re-states
it for a few periods (the other side may reconnect later)."""

import asyncio

from pdserve.shared.bus import after_reconnects


def test_after_reconnects_acts_in_the_rounds_after_each_reconnect_only():
    class Bus:
        reconnects = 0

    async def scenario():
        calls = []

        async def action():
            calls.append(bus.reconnects)
        bus = Bus()
        task = asyncio.create_task(after_reconnects(bus, 0.01, action, rounds=3))
        await asyncio.sleep(0.1)
        quiet = len(calls)
        bus.reconnects = 1
        await asyncio.sleep(0.1)
        task.cancel()
        return quiet, calls

    assert asyncio.run(scenario()) == (0, [1, 1, 1])
