"""n > 1 at the gateway: choice 0 placed at once, the others only once its KV is on its
decode worker, each with its own request id and a seed derived from the request's."""

import asyncio

import pytest

from pdserve.services.gateway import choices
from pdserve.services.gateway.errors import APIError
from pdserve.shared.messages import RouteReply, RouteRequest, Sampling, TokenChunk

REQ = RouteRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=Sampling(max_tokens=3, seed=5), model="m",
                   session_id="n-r")


def chunk(rid: str, seq: int, finished: bool = False) -> TokenChunk:
    return TokenChunk(request_id=rid, seq=seq, token_ids=[10 + seq], text="x", finished=finished,
                      finish_reason="length" if finished else None)


class FakeRelay:
    """Each request's chunks come when the test releases them; placements are recorded."""

    def __init__(self):
        self.placed: list[RouteRequest] = []
        self.gates: dict[str, asyncio.Queue] = {}

    async def run(self, req: RouteRequest):
        self.placed.append(req)
        gate = self.gates.setdefault(req.request_id, asyncio.Queue())

        async def stream():
            while True:
                item = await gate.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        return RouteReply(request_id=req.request_id, ok=True), stream()


def test_later_choices_wait_for_choice_0s_second_chunk_then_follow_it():
    async def run():
        relay = FakeRelay()
        _, streams = await choices.run(relay.run, REQ, 3)
        merged = choices.merge(streams)
        got: dict[int, list[int]] = {}

        async def read():
            async for index, c in merged:
                got.setdefault(index, []).extend(c.token_ids)
        reader = asyncio.create_task(read())
        relay.gates["r"].put_nowait(chunk("r", 0))
        await asyncio.sleep(0.01)
        assert [r.request_id for r in relay.placed] == ["r"]  # the first token alone: KV may still be on its way
        relay.gates["r"].put_nowait(chunk("r", 1))
        await asyncio.sleep(0.01)
        assert [r.request_id for r in relay.placed] == ["r", "r-1", "r-2"]
        for rid in ("r", "r-1", "r-2"):
            start = 2 if rid == "r" else 0
            for seq in range(start, 3):
                relay.gates.setdefault(rid, asyncio.Queue()).put_nowait(chunk(rid, seq, seq == 2))
        await reader
        return relay, got

    relay, got = asyncio.run(run())
    assert got == {i: [10, 11, 12] for i in range(3)}  # (chunks the reader had not taken yet: merged)
    seeds = [r.sampling.seed for r in relay.placed]
    assert seeds[0] == 5 and len(set(seeds)) == 3  # choice 0 keeps the seed
    assert choices.child(REQ, 2).sampling.seed == seeds[2]  # derived, so the same every time
    assert all(r.session_id == "n-r" and r.prompt_token_ids == REQ.prompt_token_ids for r in relay.placed)


def test_a_choice_that_fails_fails_the_merge_and_the_others_are_cancelled():
    async def run():
        relay = FakeRelay()
        _, streams = await choices.run(relay.run, REQ, 2)
        merged = choices.merge(streams)
        relay.gates["r"].put_nowait(chunk("r", 0))
        relay.gates["r"].put_nowait(chunk("r", 1))
        assert (await anext(merged))[1].seq == 0
        await asyncio.sleep(0.01)
        relay.gates["r-1"].put_nowait(APIError(503, "no decode worker"))
        with pytest.raises(APIError):
            async for _ in merged:
                pass
        return relay

    relay = asyncio.run(run())
    assert [r.request_id for r in relay.placed] == ["r", "r-1"]


def test_one_choice_is_the_request_itself():
    async def run():
        relay = FakeRelay()
        _, streams = await choices.run(relay.run, REQ, 1)
        return relay, streams
    relay, streams = asyncio.run(run())
    assert relay.placed == [REQ] and len(streams) == 1 and choices.child(REQ, 0) is REQ
