"""Crashes charged on a real Redis (pdserve/shared/state/crashes.py): a lost worker's last recorded
pass charges its suspects once however many observers report the crash (the gateway and a
router may both), a request outside it is not charged, a worker's next life is another crash,
and a worker that left in order leaves nothing to charge. With Redis away none is known (no verdict)."""

from __future__ import annotations

import asyncio

from pdserve.local.servers import free_port
from pdserve.shared.messages import WorkerBatch
from pdserve.shared.state import State


def test_a_crash_is_charged_once_per_worker_life_to_its_passs_suspects(redis_url):
    async def scenario() -> dict[str, list[str]]:
        state = State.connect(redis_url)
        await state.r.flushdb()
        got = {}
        await state.crashes.record_batch(WorkerBatch(worker="decode-0", incarnation="a", requests=["p", "n"],
                                                     new=["p"]))
        got["twice observed"] = [await state.crashes.charge("p", "decode-0") for _ in range(2)][-1]
        got["not new in the pass"] = await state.crashes.charge("n", "decode-0")
        got["another worker's"] = await state.crashes.charge("p", "decode-1")   # none recorded: nothing more
        await state.crashes.record_batch(WorkerBatch(worker="decode-0", incarnation="b", requests=["p"], new=["p"]))
        got["its next life"] = await state.crashes.charge("p", "decode-0")
        await state.crashes.record_batch(WorkerBatch(worker="prefill-0", incarnation="c", requests=["q"]))
        await state.crashes.forget_batch("prefill-0")   # it drained and left
        got["left in order"] = await state.crashes.charge("q", "prefill-0")
        await state.close()
        return got

    got = asyncio.run(scenario())
    assert got == {"twice observed": ["decode-0@a"], "not new in the pass": [], "another worker's": ["decode-0@a"],
                   "its next life": ["decode-0@a", "decode-0@b"], "left in order": []}


def test_with_redis_away_no_crash_is_known():
    async def scenario() -> list[str]:
        state = State.connect(f"redis://127.0.0.1:{free_port()}/0")
        charged = await state.crashes.charge("p", "decode-0")
        await state.close()
        return charged

    assert asyncio.run(scenario()) == []
