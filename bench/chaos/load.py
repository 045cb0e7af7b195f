"""The chaos load: every request at once, greedy and streamed, with each frame's token ids and
arrival time (bench/chaos/scenarios.py, bench/chaos/outage.py)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Outcome:
    status: int = 0
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)   # arrival of each frame with tokens (from the run's start)
    error: str = ""
    request_id: str = ""


def prompts(n: int) -> list[list[dict]]:
    topics = ["rivers", "mountains", "bridges", "comets", "forests", "harbours", "deserts", "glaciers"]
    return [[{"role": "user", "content": f"Question {i}: name three facts about {topics[i % len(topics)]} "
                                         f"and the number {i * 7}."}] for i in range(n)]


async def run_all(url: str, requests: list[list[dict]], max_tokens: int,
                  started: asyncio.Event | None = None, trigger_after: int = 0, model: str = MODEL) -> list[Outcome]:
    """Every request at once; `started` is set once `trigger_after` of them have a token."""
    outcomes = [Outcome() for _ in requests]
    with_tokens = 0
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        async def one(i: int, messages) -> None:
            nonlocal with_tokens
            out = outcomes[i]
            try:
                async with http.stream("POST", "/v1/chat/completions", json={
                        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "return_token_ids": True}) as r:
                    out.status, out.request_id = r.status_code, r.headers.get("x-request-id", "")
                    if r.status_code != 200:
                        out.error = (await r.aread()).decode(errors="replace")[:200]
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        frame = json.loads(line[6:])
                        if "error" in frame:
                            out.error = frame["error"]["message"]
                            return
                        ids = frame["choices"][0].get("token_ids") or []
                        if ids:
                            if not out.ids:
                                with_tokens += 1
                                if started is not None and with_tokens >= trigger_after:
                                    started.set()
                            out.ids += ids
                            out.times.append(time.monotonic() - start)
            except httpx.HTTPError as e:
                out.error = f"{type(e).__name__}: {e}"
        await asyncio.gather(*(one(i, m) for i, m in enumerate(requests)))
    return outcomes
