"""Workloads as lists of requests (when, prompt token ids, output tokens), all seeded:

- `trace(path)`: a trace file in the Azure CSV format (TIMESTAMP, ContextTokens,
  GeneratedTokens) or the Mooncake JSONL format (timestamp ms, input_length, output_length,
  hash_ids of 512-token blocks: equal ids give equal prompt blocks, so prefix sharing is
  replayed). Lengths are divided by `scale` for small machines (say which in every result);
  arrivals are the trace's own (times `time_scale`) unless a rate re-times them.
- `victims_and_aggressors`: short chats streaming while long prompts arrive.
- `shared_prefix`: groups of requests sharing a long system prompt.
Prompts are token ids drawn from `TOKEN_RANGE` (plain vocabulary of most tokenizers).
"""

from __future__ import annotations

import csv
import gzip
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TextIO

import numpy as np

from pdserve.planner.arrivals import arrival_times

TOKEN_RANGE = (1000, 30000)
MOONCAKE_BLOCK = 512


@dataclass
class Request:
    at: float               # seconds from the start of the run
    prompt: list[int]
    max_tokens: int
    kind: str = "request"


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(*TOKEN_RANGE, size=n)]


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n / scale))


def text(path: Path) -> TextIO:
    """A trace file's text (gzipped when its name ends in .gz)."""
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def trace(path: str | Path, scale: float = 16, limit: int | None = None, time_scale: float = 1.0,
          seed: int = 0) -> list[Request]:
    path = Path(path)
    rng = np.random.default_rng(seed)
    if path.suffix == ".csv":
        with path.open() as f:
            rows = list(csv.DictReader(f))[:limit]
        t0 = datetime.fromisoformat(rows[0]["TIMESTAMP"][:26])
        return [Request((datetime.fromisoformat(r["TIMESTAMP"][:26]) - t0).total_seconds() * time_scale,
                        _ids(rng, _scaled(int(r["ContextTokens"]), scale)),
                        _scaled(int(r["GeneratedTokens"]), scale)) for r in rows]
    with text(path) as f:
        entries: list[dict] = [json.loads(line) for line, _ in zip(f, range(limit or 10**9))]
    block = max(1, round(MOONCAKE_BLOCK / scale))
    blocks: dict[int, list[int]] = {}   # hash id → its tokens, the same wherever it appears
    out = []
    for r in entries:
        n = _scaled(r["input_length"], scale)
        prompt: list[int] = []
        for h in r["hash_ids"]:
            if h not in blocks:
                blocks[h] = _ids(np.random.default_rng([seed, h]), block)
            prompt += blocks[h]
        prompt = (prompt + _ids(rng, max(0, n - len(prompt))))[:n]
        out.append(Request(r["timestamp"] / 1000 * time_scale, prompt, _scaled(r["output_length"], scale)))
    return out


def retimed(requests: list[Request], rate: float, burstiness: float = 1.0, seed: int = 0) -> list[Request]:
    """The same requests, arriving at `rate` per second (Poisson or gamma) instead."""
    times = arrival_times(len(requests), rate, burstiness, seed)
    return [Request(t, r.prompt, r.max_tokens, r.kind) for t, r in zip(times, requests)]


def victims_and_aggressors(duration_s: float, victim_rate: float = 0.3, victim_prompt: int = 32,
                           victim_output: int = 128, aggressor_rate: float = 0.05, aggressor_prompt: int = 1024,
                           aggressor_output: int = 4, seed: int = 0) -> list[Request]:
    """Poisson streams of short chats (victims) and long prompts with short answers
    (aggressors) over `duration_s`; the first aggressor comes after the first victims stream."""
    rng = np.random.default_rng(seed)
    out: list[Request] = []
    for kind, rate, prompt, output, offset in (("victim", victim_rate, victim_prompt, victim_output, 0.0),
                                               ("aggressor", aggressor_rate, aggressor_prompt, aggressor_output,
                                                min(5.0, duration_s / 4))):
        n = max(1, int(rate * duration_s))
        for t in arrival_times(n, rate, seed=seed + len(out) + 1):
            if offset + t < duration_s:
                out.append(Request(offset + t, _ids(rng, prompt), output, kind))
    return sorted(out, key=lambda r: r.at)


def shared_prefix(n: int, groups: int = 4, prefix_tokens: int = 512, suffix_tokens: int = 32,
                  output_tokens: int = 32, rate: float = 1.0, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    prefixes = [_ids(rng, prefix_tokens) for _ in range(groups)]
    return [Request(t, prefixes[i % groups] + _ids(rng, suffix_tokens), output_tokens, f"group{i % groups}")
            for i, t in enumerate(arrival_times(n, rate, seed=seed))]
