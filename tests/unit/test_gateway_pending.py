"""What the gateway holds for a client that does not read (pdserve/services/gateway/pending.py,
choices.merge): each choice's chunks not taken yet are merged into one — text, token ids and
log probabilities appended, the latest chunk's end — so 50 unread streams cost their text and
ids, not a queued object per token; a reader that keeps up gets every chunk as it came."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

from pdserve.services.gateway import choices
from pdserve.services.gateway.pending import Pending
from pdserve.shared.engine.logprobs import Logprob
from pdserve.shared.messages import TokenChunk

STREAMS, TOKENS = 50, 1000
BOUND_PER_TOKEN = 100  # bytes held per unread token (a queued TokenChunk is ~1 KB; its text + id ~40)


def chunk(seq: int, text: str = " word", finished: bool = False, rid: str = "0f" * 16 + "-p0-3") -> TokenChunk:
    """A chunk as a decode worker publishes it: one token."""
    return TokenChunk(request_id=rid, seq=seq, token_ids=[1000 + seq], text=text, finished=finished,
                      finish_reason="length" if finished else None, prompt_tokens=40, completion_tokens=seq + 1,
                      attempt=0, worker="decode-0_1a2b3c4d")


def test_chunks_not_taken_are_merged_into_one():
    pending = Pending()
    first = chunk(5, "héllo").model_copy(update={"logprobs": [Logprob(1005, -0.5, [])],
                                                 "prompt_logprobs": [None]})
    pending.put(first)
    pending.put(chunk(6, " wörld").model_copy(update={"logprobs": [Logprob(1006, -0.25, [])]}))
    pending.put(chunk(7, "\ud83d", finished=True).model_copy(update={"logprobs": [Logprob(1007, -1.0, [])]}))
    merged = pending.take()
    assert merged is not None and not pending and pending.take() is None
    assert (merged.seq, merged.token_ids, merged.text) == (5, [1005, 1006, 1007], "héllo wörld\ud83d")
    assert [lp.token_id for lp in merged.logprobs or []] == [1005, 1006, 1007]
    assert merged.prompt_logprobs == [None]                     # the first chunk's
    assert merged.finished and merged.finish_reason == "length" and merged.completion_tokens == 8  # the latest's


def test_a_chunk_taken_alone_passes_unchanged():
    pending = Pending()
    one = chunk(0)
    pending.put(one)
    assert pending.take() is one and pending.take() is None


async def _stream(n: int, step: asyncio.Event | None = None):
    for seq in range(n):
        yield chunk(seq, finished=seq == n - 1)
        await asyncio.sleep(0)   # (the streams interleave, as chunks from the bus do)
    if step is not None:
        step.set()


def test_a_reader_that_keeps_up_gets_every_chunk_as_it_came():
    async def run():
        got: dict[int, list[TokenChunk]] = {}
        async for index, c in choices.merge([_stream(20) for _ in range(3)]):
            got.setdefault(index, []).append(c)
        return got

    got = asyncio.run(run())
    assert {i: [c.seq for c in cs] for i, cs in got.items()} == {i: list(range(20)) for i in range(3)}


def test_fifty_unread_streams_hold_their_text_not_a_chunk_per_token():
    """50 streams of 1,000 tokens each while the reader takes nothing: what the merge holds
    grows by under BOUND_PER_TOKEN bytes per token (measured with tracemalloc: every Python
    allocation still held). A queue of the chunks (the merge before) holds ~1 KB per token."""
    async def run() -> tuple[int, dict[int, TokenChunk]]:
        done = [asyncio.Event() for _ in range(STREAMS)]
        merged = choices.merge([_stream(TOKENS, done[i]) for i in range(STREAMS)])
        first = await anext(merged)   # the reader takes one chunk, then nothing while they all run
        for event in done:
            await event.wait()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        rest = {index: c async for index, c in merged}
        return held, {first[0]: first[1], **rest}

    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        held, rest = asyncio.run(run())
    finally:
        tracemalloc.stop()
    per_token = (held - before) / (STREAMS * TOKENS)
    print(f"{STREAMS} unread streams x {TOKENS} tokens: {(held - before) / 1e6:.2f} MB held, "
          f"{per_token:.0f} bytes per token")
    assert per_token < BOUND_PER_TOKEN, per_token
    assert len(rest) == STREAMS and all(len(c.token_ids) >= TOKENS - 1 and c.finished for c in rest.values())
