"""Request events on their way to Redis (pdserve/shared/notes.py): a burst is written a batch a round
trip, and an event another process acts on (a gateway's ownership of its request) is never
dropped — not when the queue is long, not while Redis is away — where a history-only one may be."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile

from pdserve.local.servers import ended, free_port, valkey_server, wait_for_port
from pdserve.shared.notes import WRITE_BATCH
from pdserve.shared.state import State, owned_key, request_key


async def written(store: State, ids: list[str]) -> int:
    async with store.r.pipeline(transaction=False) as p:
        for rid in ids:
            p.exists(request_key(rid))
        return sum(await p.execute())


def test_a_burst_is_written_a_batch_a_round_trip_and_ownership_is_never_dropped(redis_url):
    n = 1500

    async def scenario():
        store = State.connect(redis_url)
        sizes: list[int] = []
        send = store.requests.notes.send

        async def counted(batch):
            sizes.append(len(batch))
            await send(batch)

        store.requests.notes.send = counted
        for i in range(n):  # all at once: the writer runs only after
            store.requests.note(f"h{i}", "decoding", by="decode-0")          # history only
            store.requests.note(f"k{i}", "received", by="gw-b", owner="gw-b")  # the gateway's ownership record
        await store.requests.notes.flush(60)
        out = (await store.r.scard(owned_key("gw-b")), await written(store, [f"h{i}" for i in range(n)]),
               store.requests.notes.dropped, sizes)
        await store.close()
        return out

    owned, history, dropped, sizes = asyncio.run(scenario())
    assert owned == n                               # every ownership record, past the queue's limit
    assert dropped > 0 and history == n - dropped   # history beyond it dropped, and counted
    assert max(sizes) == WRITE_BATCH and len(sizes) == -(-(n + history) // WRITE_BATCH)


def test_ownership_noted_while_redis_is_away_is_written_when_it_answers():
    port = free_port()

    def redis(d: str) -> subprocess.Popen:
        proc = subprocess.Popen([valkey_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL)
        try:
            wait_for_port(port, proc=proc)
        except RuntimeError:
            ended(proc)
            raise
        return proc

    async def scenario(d: str):
        proc = redis(d)
        try:
            store = State.connect(f"redis://127.0.0.1:{port}/0")
            await store.r.ping()
            ended(proc)
            for i in range(10):
                store.requests.note(f"k{i}", "received", by="gw-a", owner="gw-a")
                store.requests.note(f"h{i}", "decoding", by="decode-0")
            await asyncio.sleep(1.5)                      # round trips fail meanwhile
            proc = redis(d)                               # back, empty
            await store.requests.notes.flush(20)
            out = await store.r.scard(owned_key("gw-a")), await written(store, [f"h{i}" for i in range(10)])
            await store.close()
            return out
        finally:
            ended(proc)

    with tempfile.TemporaryDirectory() as d:
        owned, history = asyncio.run(scenario(d))
    assert owned == 10 and history == 0
