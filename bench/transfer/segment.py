"""The `segment` arm of `make bench-transfer`: KV between two processes on one host the way
the services move it there (pdserve/shared/kv/segment.py). The sender's payloads are in its segment
(the services write each batch of layers there as they encode it, instead of into a buffer of
its own); each message is a notice over NATS naming where, as the KVLayer notice does; the
receiver copies each into a staging buffer (off its event loop above 1 MiB, as
pdserve/shared/kv/receiver.py does) and confirms the last of each payload size, like the UCX arms'
receivers."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time

from bench.children import call, children, outcome
from bench.transfer.common import ARM_TIMEOUT_S, NATS_SLOW_CONSUMER, STREAMED, reps_for
from bench.transfer.handoff import nats_server

OWNER = "bench-segment"   # the sender's worker id: where it hands its segment over


def _receiver(sizes, url, ready_q, done_q, window):
    import nats

    from pdserve.shared.kv.same_host import INLINE_COPY
    from pdserve.shared.kv.segment import Segments
    from pdserve.shared.kv.staging import Staging, size_class
    from pdserve.shared.messages import SegmentRef

    async def run():
        segments = Segments()
        staging = Staging(keep_bytes=window * sum(map(size_class, sizes)))
        copies: set[asyncio.Task] = set()
        counts = dict.fromkeys(sizes, 0)
        under_way = asyncio.Semaphore(window)  # as in the UCX arms

        async def copy(ref: SegmentRef, size: int) -> None:
            async with under_way:
                buf = staging.take(size)
                if size <= INLINE_COPY:
                    segments.read(OWNER, ref, buf)
                else:
                    await asyncio.to_thread(segments.read, OWNER, ref, buf)
                staging.give(buf)
            counts[size] += 1
            if counts[size] in (window, reps_for(size) + window):  # warmed up; done
                done_q.put(size)

        async def on_notice(msg):
            notice = json.loads(msg.data)
            task = asyncio.create_task(copy(SegmentRef(**notice["ref"]), notice["size"]))
            copies.add(task)
            task.add_done_callback(copies.discard)

        nc = await nats.connect(url)
        await nc.subscribe("bench.kv", cb=on_notice)
        await nc.flush()
        ready_q.put(segments.host)
        while any(counts[s] < reps_for(s) + window for s in sizes):
            await asyncio.sleep(0.05)
        await nc.close()
    asyncio.run(run())


async def _send(sizes, url, done_q, window):
    import nats

    from pdserve.shared.kv.segment import Segment

    nc = await nats.connect(url)
    segment = Segment(window * max(sizes), OWNER)
    loop = asyncio.get_running_loop()
    out = {}
    for size in sizes:
        taken = [segment.take(size) for _ in range(window)]  # as many as under way (the layers' KV)
        regions = [r for r in taken if r is not None]
        assert len(regions) == window, "the segment holds a window of each size"
        for _, region in regions:
            region[:] = 1
        notices = [json.dumps({"ref": ref.model_dump(), "size": size}).encode() for ref, _ in regions]
        for notice in notices:  # warm-up
            await nc.publish("bench.kv", notice)
        await nc.flush()
        assert await loop.run_in_executor(None, done_q.get, True, ARM_TIMEOUT_S) == size
        start = time.perf_counter()
        for i in range(reps_for(size)):
            await nc.publish("bench.kv", notices[i % window])
        await nc.flush()
        assert await loop.run_in_executor(None, done_q.get, True, ARM_TIMEOUT_S) == size
        out[size] = size * reps_for(size) / (time.perf_counter() - start) / 1e9
        for ref, _ in regions:
            segment.give(ref)
    await nc.close()
    return out


def _sender(sizes, url, done_q, window):
    return asyncio.run(_send(sizes, url, done_q, window))


def bench_segment(sizes, window: int = STREAMED):
    """GB/s through a segment, sender and receiver each in a fresh process; the receiver
    copies up to `window` payloads at a time (on two cores, two copies run at once)."""
    with nats_server(NATS_SLOW_CONSUMER) as url:
        ctx = mp.get_context("spawn")
        ready_q, done_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        with children(ctx.Process(target=_receiver, args=(sizes, url, ready_q, done_q, window))):
            ready_q.get(timeout=60)
            with children(ctx.Process(target=call, args=(_sender, (sizes, url, done_q, window), result_q))):
                return outcome(result_q.get(timeout=ARM_TIMEOUT_S * 2))
