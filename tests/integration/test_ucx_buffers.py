"""A UCX request owns its buffer until UCX completes it, whatever happens to its caller (real
UCX, one process talking to itself, each case in a fresh process: one UCX context each).

A decode worker gives up receives all the time (client hung up, prefill side failed, deadline)
while their payloads are still on the way. ucxx cannot cancel a request, so a receive whose
buffer was freed with its caller went on to write the payload into freed memory: heap
corruption ("free(): corrupted unsorted chunks"), aborts and hung event loops under
cancellations.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytestmark = pytest.mark.slow
SIZES = [512, 6_000, 70_000, 300_000, 2_000_000]  # eager and rendezvous; malloc heap and mmap


def _in_fresh_process(target, timeout=60) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(out,))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"{target.__name__} hung for {timeout} s")
    assert proc.exitcode == 0, f"{target.__name__} died with exit code {proc.exitcode}"
    return out.get(timeout=5)


def _buffers_outlive_their_callers(out):
    """Receives posted into buffers only they hold (eager and rendezvous sizes), their callers
    cancelled and collected, then the payloads sent: each buffer must live until its payload
    has landed, and be released after."""
    import asyncio
    import gc
    import weakref

    import numpy as np

    from pdserve.shared.kv import create_transport

    async def run():
        t = create_transport("ucx")
        buffers = [np.empty(n, dtype=np.uint8) for n in SIZES]
        refs = [weakref.ref(b) for b in buffers]
        callers = [asyncio.create_task(t.recv(tag, b)) for tag, b in enumerate(buffers)]
        del buffers
        await asyncio.sleep(0.02)
        for caller in callers:
            caller.cancel()
        cancelled = sum(isinstance(x, asyncio.CancelledError)
                        for x in await asyncio.gather(*callers, return_exceptions=True))
        del callers, caller  # (a cancelled task's traceback holds its frame, and so the buffer)
        gc.collect()
        alive_while_open = sum(r() is not None for r in refs)
        await asyncio.gather(*(t.send(t.address, tag, np.full(n, 7, dtype=np.uint8)) for tag, n in enumerate(SIZES)))
        for _ in range(200):  # until every receive has landed
            if not getattr(t, "requests", ()):
                break
            await asyncio.sleep(0.01)
        gc.collect()
        return {"cancelled": cancelled, "alive_while_open": alive_while_open,
                "alive_after": sum(r() is not None for r in refs), "open": len(getattr(t, "requests", ()))}

    out.put(asyncio.run(run()))


def test_a_receive_holds_its_buffer_until_the_payload_lands_even_after_its_caller_left():
    res = _in_fresh_process(_buffers_outlive_their_callers)
    assert res["cancelled"] == len(SIZES), res                # every caller saw its cancellation
    assert res["alive_while_open"] == len(SIZES), res         # freed here, the payload would land in freed memory
    assert res["alive_after"] == 0 and res["open"] == 0, res  # and nothing is kept once it has landed


def _receive_and_leave(out):
    """A receive whose caller left: it lands in the buffer it was given (so that buffer had to
    live); one whose message never comes is retired after the grace period."""
    import asyncio

    import numpy as np

    from pdserve.shared.kv.ucx import UcxTransport

    async def run():
        t = UcxTransport(orphan_grace_s=1.0)  # far longer than a local send takes, even on a busy machine
        held = np.zeros(100_000, dtype=np.uint8)
        caller = asyncio.create_task(t.recv(1, held))
        await asyncio.sleep(0.02)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        open_after_cancel = len(t.requests)
        await t.send(t.address, 1, np.full(held.size, 7, dtype=np.uint8))
        for _ in range(100):
            if not t.requests:
                break
            await asyncio.sleep(0.01)
        landed = bool((held == 7).all())

        never = asyncio.create_task(t.recv(2, np.empty(4096, dtype=np.uint8)))
        await asyncio.sleep(0.02)
        never.cancel()
        await asyncio.gather(never, return_exceptions=True)
        await asyncio.sleep(0.1)
        open_in_grace = len(t.requests)
        for _ in range(500):  # until the grace period has passed and the receive was retired
            if t.retired and not t.requests:
                break
            await asyncio.sleep(0.01)
        # the transport still works afterwards, tag 2 included
        again = np.zeros(4096, dtype=np.uint8)
        await asyncio.gather(t.recv(2, again), t.send(t.address, 2, np.full(4096, 9, dtype=np.uint8)))
        return {"open_after_cancel": open_after_cancel, "landed": landed, "open_in_grace": open_in_grace,
                "retired": t.retired, "open_at_end": len(t.requests), "again": bool((again == 9).all())}

    out.put(asyncio.run(run()))


def test_a_receive_left_by_its_caller_lands_or_is_retired():
    res = _in_fresh_process(_receive_and_leave)
    assert res["open_after_cancel"] == 1 and res["landed"], res      # UCX wrote after the caller left
    assert res["open_in_grace"] == 1 and res["retired"] == 1, res    # never answered: retired after grace
    assert res["open_at_end"] == 0 and res["again"], res


def _wait_idle(out):
    """A receive posted for 0.5 s with nothing on the way: how much CPU the event loop's thread
    spends meanwhile, then that the receive still completes."""
    import asyncio
    import time

    import numpy as np

    from pdserve.shared.kv import create_transport

    async def run():
        t = create_transport("ucx")
        buf = np.zeros(4096, dtype=np.uint8)
        waiting = asyncio.create_task(t.recv(3, buf))
        await asyncio.sleep(0.05)
        cpu = time.thread_time()
        await asyncio.sleep(0.5)
        cpu = time.thread_time() - cpu
        await t.send(t.address, 3, np.full(4096, 5, dtype=np.uint8))
        await asyncio.wait_for(waiting, 5)
        return {"loop_cpu_s": cpu, "landed": bool((buf == 5).all())}

    out.put(asyncio.run(run()))


def test_a_waiting_receive_leaves_the_event_loop_idle():
    # ucxx's default awaits a request by polling it with asyncio.sleep(0): the loop's thread ran
    # ~0.5 s of CPU here, holding the GIL the engine thread needs
    res = _in_fresh_process(_wait_idle)
    assert res["landed"], res
    assert res["loop_cpu_s"] < 0.1, res
