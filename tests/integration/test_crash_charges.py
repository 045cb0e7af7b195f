"""Crashes charged on a real Redis (pdserve/shared/state/crashes.py): a lost worker's last recorded
pass charges its suspects once however many observers report the crash (the gateway and a
router may both), a request outside it is not charged, a worker's next life is another crash,
and a worker that left in order leaves nothing to charge; with no worker lost they are only read. With Redis
away none is known (no verdict)."""

from __future__ import annotations

import asyncio

import pytest
from helpers import GREEDY, generate, run_all, tokens

from pdserve.local.servers import free_port
from pdserve.shared import quarantine
from pdserve.shared.batches import Batches
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import Engine
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
        got["none lost: only read"] = await state.crashes.charge("p", "")
        await state.crashes.record_batch(WorkerBatch(worker="prefill-0", incarnation="c", requests=["q"]))
        await state.crashes.forget_batch("prefill-0")   # it drained and left
        got["left in order"] = await state.crashes.charge("q", "prefill-0")
        await state.close()
        return got

    got = asyncio.run(scenario())
    assert got == {"twice observed": ["decode-0@a"], "not new in the pass": [], "another worker's": ["decode-0@a"],
                   "its next life": ["decode-0@a", "decode-0@b"], "none lost: only read": ["decode-0@a", "decode-0@b"],
                   "left in order": []}


def test_with_redis_away_no_crash_is_known():
    async def scenario() -> list[str]:
        state = State.connect(f"redis://127.0.0.1:{free_port()}/0")
        charged = await state.crashes.charge("p", "decode-0")
        await state.close()
        return charged

    assert asyncio.run(scenario()) == []


class Crash(Exception):
    """A worker dying in a pass (PD_FAULT_CRASH_ON_PROMPT's os._exit, in-process)."""


def test_a_request_that_shared_the_poisons_pass_is_served_and_the_poison_quarantined(redis_url, fake):
    """pdserve/shared/quarantine.py end to end on engines, the pass recorder and Redis: the poison ("p")
    crashes its first worker in a pass it shares with "i" (both new: both charged). Placed again with
    one crash each, their next worker runs each of them alone, so the poison's second crash is
    charged to it alone (quarantined); "i" and a stream running there ("r") are charged nothing more,
    and "i" is served on a third worker, its tokens a plain run's."""
    prompts = {rid: fake.tokenizer.encode(text) for rid, text in (
        ("p", "Tell me about the poison apple."), ("i", "What do bees make?"), ("r", "What is rain?"))}

    async def scenario() -> tuple[dict[str, list[str]], dict[str, list[set[str]]], list[int]]:
        state = State.connect(redis_url)
        await state.r.flushdb()
        loop, passes = asyncio.get_running_loop(), {}

        def worker(name: str) -> Engine:
            eng, recorder = Engine(fake, EngineConfig(num_blocks=256)), Batches(name, state.crashes.record_batch)
            recorder.loop = loop

            def before_pass(seqs: list) -> None:
                recorder.before_pass(seqs, eng.seqs.keys())
                passes.setdefault(name, []).append({s.request_id for s in seqs})
                if any(s.request_id == "p" for s in seqs):
                    raise Crash(name)
            eng.before_pass = before_pass
            return eng

        async def run(eng: Engine, rids: tuple[str, ...], crashes: dict[str, int]) -> dict[str, list[int]]:
            for rid in rids:
                eng.add_request(rid, prompts[rid], GREEDY, crashes=crashes.get(rid, 0))
            return {rid: tokens(outs) for rid, outs in (await asyncio.to_thread(run_all, eng)).items()}

        with pytest.raises(Crash):
            await run(worker("prefill-0"), ("i", "p"), {})
        crashes = {rid: len(await state.crashes.charge(rid, "prefill-0")) for rid in ("p", "i")}
        second = worker("decode-0")
        second.add_request("r", prompts["r"], GREEDY)
        await asyncio.to_thread(second.step)  # "r" runs there
        with pytest.raises(Crash):
            await run(second, ("i", "p"), crashes)
        charged = {rid: await state.crashes.charge(rid, "decode-0") for rid in ("p", "i", "r")}
        served = await run(worker("decode-1"), ("i",), {"i": len(charged["i"])})
        await state.close()
        return charged, passes, served["i"]

    charged, passes, served = asyncio.run(scenario())
    assert passes["prefill-0"] == [{"i", "p"}]                      # together in the first crash
    assert passes["decode-0"][-1] == {"p"} and {"i", "r"} in passes["decode-0"]   # alone in the second; "i" went on
    assert [len(charged[rid]) for rid in ("p", "i", "r")] == [2, 1, 0] and quarantine.quarantined(charged["p"])
    assert served == generate(fake, {"i": prompts["i"]}, GREEDY)["i"]
