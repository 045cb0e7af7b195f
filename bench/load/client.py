"""A streaming client for any OpenAI-compatible server: sends each request at its arrival
time (or keeps `concurrency` in flight), records when each chunk of tokens arrived.

Requests go to `/v1/completions` with the prompt as token ids, `stream: true`,
`ignore_eos: true` and `max_tokens` (so every server generates the same lengths; servers
that do not know `ignore_eos` ignore it), temperature 0. Tokens per chunk come from
`token_ids` (pdserve's `return_token_ids`) when the server sends them, else one per
non-empty chunk."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from pdserve.planner.metrics import Timing
from pdserve.planner.workloads import Request


async def one(http: httpx.AsyncClient, model: str, req: Request) -> Timing:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    timing = Timing(sent=time.perf_counter(), prompt_tokens=len(req.prompt))
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                timing.ok, timing.error = False, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return timing
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                data = json.loads(line[6:])
                if "error" in data:
                    timing.ok, timing.error = False, str(data["error"])
                    break
                for choice in data.get("choices", []):
                    ids = choice.get("token_ids")
                    n = len(ids) if ids is not None else int(bool(choice.get("text")))
                    if n:
                        timing.chunks.append((now, n))
    except httpx.HTTPError as e:
        timing.ok, timing.error = False, f"{type(e).__name__}: {e}"
    return timing


async def run(base_url: str, model: str, requests: list[Request], concurrency: int = 0,
              timeout_s: float = 600) -> tuple[list[Timing], float]:
    """All requests; returns their timings (in the order given) and the run's duration.
    concurrency 0: each at its `at`; otherwise at most that many in flight, as fast as possible."""
    limits = httpx.Limits(max_connections=max(concurrency, len(requests), 1))
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, limits=limits) as http:
        gate = asyncio.Semaphore(concurrency) if concurrency else None
        start = time.perf_counter()

        async def scheduled(req: Request) -> Timing:
            if gate is not None:
                async with gate:
                    return await one(http, model, req)
            await asyncio.sleep(max(0.0, start + req.at - time.perf_counter()))
            return await one(http, model, req)

        timings = await asyncio.gather(*(scheduled(r) for r in requests))
        return list(timings), time.perf_counter() - start
