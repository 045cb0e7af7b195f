"""EngineHost.run with `overlap`: a step's outputs are handed on while the next step computes,
in order, each hand-off done before the next begins, the last one done before the loop returns."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from pdserve.shared.engine.engine import Pass, RequestOutput
from pdserve.shared.engine_host import EngineHost

WAIT_S = 30.0  # only a failing test waits this long


class Steps:
    """An engine of `n` steps, one output each; step k (from 0) waits on the engine thread until
    `release[k]` is set, and says it began in `began[k]`."""

    def __init__(self, n: int) -> None:
        self.n, self.done = n, 0
        self.began = [threading.Event() for _ in range(n)]
        self.release = [threading.Event() for _ in range(n)]
        self.last_pass = Pass(1, 0)
        self.fail_at = -1  # the step that raises

    def has_work(self) -> bool:
        return self.done < self.n

    def step(self) -> list[RequestOutput]:
        k = self.done
        self.began[k].set()
        if k == self.fail_at:
            raise RuntimeError(f"step {k} failed")
        assert self.release[k].wait(WAIT_S)
        self.done += 1
        return [RequestOutput("r", [k], str(k), k == self.n - 1, None, 1, k + 1, 0)]

    def drain_cache_changes(self) -> list:
        return []


async def run_to_the_end(engine: Steps, host: EngineHost, handed: Callable[[list[RequestOutput]], Awaitable[None]],
                         overlap: bool = True) -> None:
    """Step 0 released, the host's loop run until the engine has no work and the last outputs are handed on."""
    engine.release[0].set()
    stop = asyncio.Event()
    stop.set()
    await asyncio.wait_for(host.run(handed, stop, overlap=overlap), (2 if overlap else 1) * WAIT_S)
    host.close()


def test_outputs_are_handed_on_while_the_next_step_computes_in_order() -> None:
    async def run() -> tuple[list[str], int]:
        engine = Steps(3)
        host = EngineHost(engine)  # type: ignore[arg-type]
        log: list[str] = []

        async def handed(outputs: list[RequestOutput]) -> None:
            k = outputs[0].new_token_ids[0]
            log.append(f"hand {k}")
            if k + 1 < engine.n:  # the next step has begun before this hand-off ends
                began = await asyncio.to_thread(engine.began[k + 1].wait, WAIT_S)
                log.append(f"step {k + 1} began" if began else f"step {k + 1} did not begin")
                await asyncio.sleep(0)
                engine.release[k + 1].set()
            log.append(f"handed {k}")

        await run_to_the_end(engine, host, handed)
        return log, engine.done

    log, done = asyncio.run(run())
    assert done == 3
    assert log == ["hand 0", "step 1 began", "handed 0", "hand 1", "step 2 began", "handed 1", "hand 2", "handed 2"]


def test_a_call_made_while_the_engine_steps_ahead_runs_before_the_next_step() -> None:
    async def run() -> list[str]:
        engine = Steps(3)
        host = EngineHost(engine)  # type: ignore[arg-type]
        log: list[str] = []

        async def handed(outputs: list[RequestOutput]) -> None:
            k = outputs[0].new_token_ids[0]
            if k == 0:
                assert await asyncio.to_thread(engine.began[1].wait, WAIT_S)
                call = asyncio.ensure_future(host.call(lambda: log.append(f"call (step 2 began: "
                                                                         f"{engine.began[2].is_set()})")))
                await asyncio.sleep(0)  # (the call is made)
                engine.release[1].set()
                await call
            elif k == 1:
                engine.release[2].set()
            log.append(f"handed {k}")

        await run_to_the_end(engine, host, handed)
        return log

    assert asyncio.run(run()) == ["call (step 2 began: False)", "handed 0", "handed 1", "handed 2"]


def test_a_call_given_up_before_it_began_does_not_hold_the_engine_back() -> None:
    async def run() -> int:
        engine = Steps(3)
        host = EngineHost(engine)  # type: ignore[arg-type]

        async def handed(outputs: list[RequestOutput]) -> None:
            if outputs[0].new_token_ids[0] == 0:
                assert await asyncio.to_thread(engine.began[1].wait, WAIT_S)
                call = asyncio.ensure_future(host.call(lambda: None))  # queued behind step 1...
                await asyncio.sleep(0)
                call.cancel()  # ...and given up (a cancelled admit): it never runs
                await asyncio.sleep(0)
                engine.release[1].set()
                engine.release[2].set()

        await run_to_the_end(engine, host, handed)
        return engine.done

    assert asyncio.run(run()) == 3


def test_without_overlap_a_step_waits_for_the_outputs_before_it() -> None:
    async def run() -> list[str]:
        engine = Steps(2)
        host = EngineHost(engine)  # type: ignore[arg-type]
        log: list[str] = []

        async def handed(outputs: list[RequestOutput]) -> None:
            k = outputs[0].new_token_ids[0]
            log.append(f"hand {k} (step {k + 1} began: {k + 1 < engine.n and engine.began[k + 1].is_set()})")
            if k + 1 < engine.n:
                engine.release[k + 1].set()

        await run_to_the_end(engine, host, handed, overlap=False)
        return log

    assert asyncio.run(run()) == ["hand 0 (step 1 began: False)", "hand 1 (step 2 began: False)"]


def test_a_step_that_raises_still_hands_on_the_outputs_of_the_step_before() -> None:
    async def run() -> tuple[list[int], bool]:
        engine = Steps(2)
        engine.fail_at = 1
        host = EngineHost(engine)  # type: ignore[arg-type]
        handed: list[int] = []

        async def hand(outputs: list[RequestOutput]) -> None:
            await asyncio.to_thread(engine.began[1].wait, WAIT_S)  # still under way as the next step raises
            handed.append(outputs[0].new_token_ids[0])

        engine.release[0].set()
        raised = False
        try:
            await asyncio.wait_for(host.run(hand, asyncio.Event(), overlap=True), WAIT_S)
        except RuntimeError:
            raised = True
        host.close()
        return handed, raised

    assert asyncio.run(run()) == ([0], True)
