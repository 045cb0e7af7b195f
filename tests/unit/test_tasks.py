"""Background tasks: held until they end, even when their awaiter is cancelled; failures logged."""

import asyncio
import gc
import logging

from pdserve.shared.tasks import Background


def test_a_task_outlives_its_cancelled_awaiter_and_its_failure_is_logged(caplog):
    async def run():
        bg = Background(logging.getLogger("t"), "work")
        done = asyncio.Event()

        async def work():
            await asyncio.sleep(0.05)
            done.set()
            raise RuntimeError("boom")

        async def awaiting():
            await asyncio.shield(bg.start(work()))

        awaiter = asyncio.create_task(awaiting())
        await asyncio.sleep(0.01)
        awaiter.cancel()
        gc.collect()
        held = len(bg)
        await asyncio.wait_for(done.wait(), 2)
        await asyncio.sleep(0)
        return held, len(bg)

    with caplog.at_level(logging.WARNING):
        held, left = asyncio.run(run())
    assert (held, left) == (1, 0)
    assert "work failed: boom" in caplog.text
