"""`n` > 1: several choices from one prompt, each a request of its own through the system
(its own placement, failover, cancel and timeline), with the prompt prefilled once.

    choice 0        placed at once, as a request with n = 1 is
    choices 1..n-1  placed once choice 0's KV is on its decode worker (its second chunk, or its
                    end), under one session, so the router sends them to that worker: there
                    the prompt's full blocks are in the prefix cache and each choice computes
                    only the prompt's last, partial block (fewer than block_size tokens)

Choice 0 keeps the request's seed (so it equals the answer with n = 1) and choice i draws
with a seed derived from (seed, i): a seeded request gives the same n answers every time.
Their chunks are merged into one stream of (choice index, chunk) as they come.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import xxhash

from pdserve.services.gateway import ids
from pdserve.services.gateway.pending import Pending
from pdserve.shared.messages import RouteReply, RouteRequest, TokenChunk

Run = Callable[[RouteRequest], Awaitable[tuple[RouteReply, AsyncIterator[TokenChunk]]]]


def child(req: RouteRequest, index: int) -> RouteRequest:
    """Choice `index`'s request (choice 0 is the request itself)."""
    if index == 0:
        return req
    seed = req.sampling.seed
    sampling = req.sampling if seed is None else req.sampling.model_copy(
        update={"seed": xxhash.xxh64_intdigest(f"{seed}:choice{index}".encode()) & 0x7FFF_FFFF_FFFF_FFFF})
    return req.model_copy(update={"request_id": ids.choice_id(req.request_id, index), "sampling": sampling})


async def run(relay_run: Run, req: RouteRequest, n: int) -> tuple[RouteReply, list[AsyncIterator[TokenChunk]]]:
    """Place choice 0 now and the others after it (above); each choice's ordered chunks. A
    choice placed later that cannot be placed raises (APIError) from its stream."""
    placement, first = await relay_run(req)
    if n == 1:
        return placement, [first]
    landed = asyncio.Event()

    async def lead() -> AsyncIterator[TokenChunk]:
        try:
            async for chunk in first:
                if chunk.seq >= 1 or chunk.finished:  # (an error is raised by the relay: the finally)
                    landed.set()
                yield chunk
        finally:
            landed.set()

    async def follow(index: int) -> AsyncIterator[TokenChunk]:
        await landed.wait()
        _, chunks = await relay_run(child(req, index))
        async for chunk in chunks:
            yield chunk

    return placement, [lead(), *(follow(i) for i in range(1, n))]


async def merge(streams: list[AsyncIterator[TokenChunk]]) -> AsyncGenerator[tuple[int, TokenChunk]]:
    """(choice index, chunk) from every stream as they come; a stream's error is raised here,
    after its chunks. Each stream is read as fast as it comes: what the reader has not taken yet
    waits merged, one chunk per choice (pending.py), the choices taken in turn. Closing this
    generator cancels every stream still running."""
    pending = [Pending() for _ in streams]
    ends: dict[int, Exception | None] = {}   # a stream's end: None, or its error
    ready = asyncio.Event()

    async def pump(index: int, stream: AsyncIterator[TokenChunk]) -> None:
        try:
            async for chunk in stream:
                pending[index].put(chunk)
                ready.set()
            ends[index] = None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader, who raises it
            ends[index] = e
        ready.set()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = set(range(len(tasks)))
        while open_streams:
            await ready.wait()
            ready.clear()
            for index in sorted(open_streams):
                if (chunk := pending[index].take()) is not None:
                    yield index, chunk
                if index in ends and not pending[index]:
                    open_streams.discard(index)
                    if (error := ends[index]) is not None:
                        raise error
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
