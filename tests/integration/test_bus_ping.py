"""Liveness pings are their own message: a subscriber's bus answers a Ping, its handler never
sees one, and a subject nobody subscribes to gets the server's no-responders answer."""

from __future__ import annotations

import asyncio

from pdserve.shared.bus import Bus
from pdserve.shared.messages import KVSync


def test_a_ping_is_answered_by_the_bus_and_never_reaches_the_handler(nats_url):
    async def run() -> None:
        worker, asker = await Bus.connect(nats_url, "worker"), await Bus.connect(nats_url, "asker")
        seen: list[bytes] = []

        async def handler(msg) -> None:
            seen.append(msg.data)
        await worker.subscribe("pd.test.sync", handler)
        # twice: nats-py writes a flush's PING straight to the socket, ahead of a SUB still queued for its
        # flusher task, so one PONG can come back before the server has the subscription (a busy machine)
        await worker.nc.flush()
        await worker.nc.flush()
        assert await asker.heard("pd.test.sync", 2.0) is True
        assert await asker.heard("pd.test.nobody", 2.0) is False
        await asker.publish("pd.test.sync", KVSync(request_id="r1"))   # data still reaches the handler
        for _ in range(50):
            if seen:
                break
            await asyncio.sleep(0.02)
        assert [KVSync.decode(d).request_id for d in seen] == ["r1"]
        await worker.close()
        assert await asker.heard("pd.test.sync", 2.0) is False        # its connection gone: no responders
        await asker.close()

    asyncio.run(run())
