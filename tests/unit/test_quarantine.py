"""A request that crashes workers (pdserve/shared/quarantine.py, pdserve/shared/batches.py): which
requests a crash is charged to, when a request is failed instead of placed again, what its client
reads; and the engine-pass record a worker leaves behind — written before a pass whose requests
changed, never for a pass like the last one, not waited for while the store is away."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from pdserve.shared import batches, quarantine
from pdserve.shared.lifecycle import Summary
from pdserve.shared.messages import WorkerBatch


def test_a_crash_is_charged_to_the_requests_new_in_its_pass_else_to_all():
    joined = WorkerBatch(worker="decode-0", incarnation="a1", requests=["r1", "r2", "r3"], new=["r3"])
    steady = WorkerBatch(worker="decode-0", incarnation="a1", requests=["r1", "r2"])
    assert quarantine.suspects(joined) == {"r3"}
    assert quarantine.suspects(steady) == {"r1", "r2"}
    assert quarantine.crash_of(joined) == "decode-0@a1"


def test_the_second_crash_quarantines_and_the_client_reads_which_workers():
    assert not quarantine.quarantined([])
    assert not quarantine.quarantined(["decode-0@a1"])
    assert quarantine.quarantined(["decode-0@a1", "prefill-1@b2"])
    text = quarantine.message(["prefill-1@b2", "decode-0@a1"])
    assert "2 workers (decode-0, prefill-1)" in text and "not placed again" in text
    assert 400 <= quarantine.STATUS < 500 and quarantine.STATUS != 400   # no retry, no field to blame


def test_a_request_charged_a_crash_runs_its_prompt_and_first_steps_alone():
    assert not quarantine.runs_alone(0, 0)                                   # never charged
    assert quarantine.runs_alone(1, 0)                                       # its prompt
    assert quarantine.runs_alone(1, quarantine.ALONE_STEPS)                  # its first decode steps here
    assert not quarantine.runs_alone(1, quarantine.ALONE_STEPS + 1)          # then it joins the batch


def test_a_dead_letter_moves_only_a_request_still_waiting_on_that_job():
    waiting = Summary(phase="prefilling", attempt=1, prefill="prefill-0")
    assert quarantine.waits_on(waiting, "prefill-0", 1)
    assert not quarantine.waits_on(waiting, "prefill-1", 1)                    # requeued elsewhere since
    assert not quarantine.waits_on(waiting, "prefill-0", 0)                    # an older placement's job
    assert not quarantine.waits_on(waiting.model_copy(update={"phase": "decoding"}), "prefill-0", 1)
    assert not quarantine.waits_on(waiting.model_copy(update={"phase": "failed"}), "prefill-0", 1)


@dataclass
class Seq:  # what the recorder reads of an engine Sequence
    request_id: str
    token_ids: list[int]
    num_prompt: int


def _passes(recorder: batches.Batches, passes: list[list[str]], resident: set[str] | None = None) -> None:
    """Each pass's requests told to the recorder from a thread (the engine's), while the loop runs."""
    async def run() -> None:
        recorder.loop = asyncio.get_running_loop()
        for ids in passes:
            seqs = [Seq(rid, [1, 2, 3], 3) for rid in ids]
            await asyncio.to_thread(recorder.before_pass, seqs, resident if resident is not None else set(ids))
    asyncio.run(run())


def test_a_pass_is_recorded_when_its_requests_change_with_those_on_their_first_pass_until_it_is_done():
    written: list[WorkerBatch] = []

    async def write(batch: WorkerBatch) -> None:
        written.append(batch)

    recorder = batches.Batches("decode-0", write)
    _passes(recorder, [["a"], ["a"], ["a"], ["a", "b"], ["a", "b"], ["b"], ["b", "c"]], resident={"a", "b", "c"})
    assert [(w.requests, w.new) for w in written] == [   # (after a first pass, none is new)
        (["a"], ["a"]), (["a"], []), (["a", "b"], ["b"]), (["a", "b"], []), (["b"], []), (["b", "c"], ["c"])]
    assert {w.incarnation for w in written} == {recorder.incarnation} and written[0].worker == "decode-0"


def test_a_request_that_left_the_engine_is_new_again_when_it_returns():
    written: list[WorkerBatch] = []

    async def write(batch: WorkerBatch) -> None:
        written.append(batch)

    recorder = batches.Batches("decode-0", write)
    _passes(recorder, [["a"], ["b"], ["a"]])   # `a` gone from the engine while `b` ran (resident: each pass's)
    assert [w.new for w in written] == [["a"], ["b"], ["a"]]


def test_a_store_that_does_not_answer_costs_one_wait_then_records_nothing_for_a_while(monkeypatch):
    monkeypatch.setattr(batches, "RECORD_TIMEOUT_S", 0.05)
    calls: list[WorkerBatch] = []

    async def hang(batch: WorkerBatch) -> None:
        calls.append(batch)
        await asyncio.sleep(10)

    recorder = batches.Batches("decode-0", hang)
    start = time.monotonic()
    _passes(recorder, [["a"], ["b"], ["c"], ["d"]])
    assert time.monotonic() - start < 1 and len(calls) == 1   # waited once, then none written
    assert recorder.away_until > time.monotonic()


def test_the_crash_fault_kills_the_process_in_a_pass_holding_the_prompt(monkeypatch):
    died: list[int] = []

    def exit_(code: int) -> None:
        died.append(code)
        raise SystemExit(code)

    async def write(batch: WorkerBatch) -> None:
        pass

    monkeypatch.setattr(batches.os, "_exit", exit_)
    recorder = batches.Batches("decode-0", write, crash_on="poison", text=lambda ids: "poison" if 9 in ids else "ok")
    recorder.before_pass([Seq("fine", [1, 2], 2)], {"fine"})
    assert not died
    with pytest.raises(SystemExit):
        recorder.before_pass([Seq("fine", [1, 2], 2), Seq("bad", [9, 1], 2)], {"fine", "bad"})
    assert died == [batches.CRASH_EXIT_CODE]
