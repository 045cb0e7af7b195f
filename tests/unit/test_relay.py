"""The gateway's ordering of token chunks: in seq order, duplicates dropped, cancel when left early."""

import asyncio

from shared.messages import Cancel, TokenChunk
from services.gateway.relay import Relay


class FakeBus:
    def __init__(self):
        self.published = []

    async def publish(self, subject, msg, ctx=None):
        self.published.append((subject, msg))


class FakeSub:
    unsubscribed = False

    async def unsubscribe(self):
        self.unsubscribed = True


def chunk(seq, n=1, finished=False):
    return TokenChunk(request_id="r", seq=seq, token_ids=list(range(n)), text=f"<{seq}>", finished=finished)


def collect(chunks, stop_after=None):
    async def run():
        bus, sub, queue = FakeBus(), FakeSub(), asyncio.Queue()
        for c in chunks:
            queue.put_nowait(c)
        got = []
        gen = Relay(bus, 1, 0.2)._ordered("r", queue, sub)
        async for c in gen:
            got.append(c.seq)
            if stop_after is not None and len(got) == stop_after:
                break
        await gen.aclose()
        return got, bus.published, sub.unsubscribed
    return asyncio.run(run())


def test_out_of_order_and_duplicate_chunks_come_out_once_in_order():
    got, published, unsubscribed = collect([chunk(1), chunk(0), chunk(0), chunk(2, n=2), chunk(1),
                                            chunk(4, finished=True)])
    assert got == [0, 1, 2, 4] and published == [] and unsubscribed


def test_leaving_early_cancels_the_request_everywhere():
    got, published, _ = collect([chunk(0), chunk(1), chunk(2, finished=True)], stop_after=1)
    assert got == [0]
    assert published == [("pd.cancel.r", Cancel(request_id="r"))]
