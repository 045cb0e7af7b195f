"""Clients that hang up at random moments, on the session's stack (tests/conftest.py: the real
model, 1 prefill + 1 decode worker, UCX between them): every process stays up and every
worker's KV pool is whole again."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from conftest import MODEL

from pdserve.shared.state import worker_key
from pdserve.shared.urls import sync_redis


@pytest.mark.slow   # (the session's stack: the real model)
def test_200_streams_cancelled_at_random_points_leave_no_block_taken(stack):
    """Clients hang up at random moments — before the placement, during prefill or the KV
    handoff, after some tokens — 25 at a time; afterwards every process is up and every
    worker's KV pool is whole. (A decode worker that gave up receives with payloads in flight
    used to free buffers UCX was still writing into: heap corruption, then an abort or a hang.)
    On the session's stack (1 prefill + 1 decode worker): the tests after it use it as it leaves it."""
    import asyncio
    import random

    rng = random.Random(7)
    plans = [("timeout", rng.uniform(0.02, 1.5)) if rng.random() < 0.35 else ("frames", rng.randint(0, 10))
             for _ in range(200)]

    async def run(url: str) -> dict[str, int]:
        gate, seen = asyncio.Semaphore(25), {"timeout": 0, "frames": 0, "completed": 0}
        async with httpx.AsyncClient(base_url=url) as http:
            async def one(i: int, kind: str, arg):
                body = {"model": MODEL, "stream": True, "max_tokens": 16, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"Story {i % 17}: tell it {'slowly ' * (i % 5)}."}]}
                async with gate:
                    try:
                        async with http.stream("POST", "/v1/chat/completions", json=body,
                                               timeout=arg if kind == "timeout" else 120) as r:
                            frames = 0
                            async for line in r.aiter_lines():
                                frames += line.startswith("data: ")
                                if kind == "frames" and frames > arg:
                                    seen["frames"] += 1
                                    return   # hang up
                            seen["completed"] += 1
                    except httpx.TimeoutException:
                        seen["timeout"] += 1
            await asyncio.gather(*(one(i, kind, arg) for i, (kind, arg) in enumerate(plans)))
        return seen

    seen = asyncio.run(run(stack.url))
    store = sync_redis(stack.redis_url)

    def pools():
        infos = [json.loads(store.get(k)) for k in store.keys(worker_key("*"))]
        return {w["worker_id"]: (w["free_blocks"], w["total_blocks"], w["running"], w["waiting"])
                for w in infos if w["role"] in ("prefill", "decode")}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(f != t or r or w for f, t, r, w in pools().values()):
        time.sleep(0.3)
    final = pools()
    dead = {name: p.poll() for name, p in stack.procs.items() if p.poll() is not None}
    print(f"cancelled streams: {seen}; pools after: {final}")
    assert not dead, f"processes died under the cancellations: {dead}"
    assert seen["timeout"] + seen["frames"] >= 150 and sum(seen.values()) == 200, seen
    assert len(final) == 2 and all(f == t and r == 0 and w == 0 for f, t, r, w in final.values()), final
