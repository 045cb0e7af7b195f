"""The simulated fleet's plan for `make bench-scale` (pure: no I/O but reading the trace).

- Prompts: each Mooncake hash id (one 512-token block of the trace) becomes one engine block
  of BLOCK tokens derived from the id, so a request of n hash ids is n * BLOCK tokens plus one
  last token (the engine always computes the last token: all n blocks can hit), and
  `pdserve.shared.hashing.block_hashes` gives the chained hashes the router looks up.
- Caches: the trace's first part (`history`) is replayed through the prefill choice
  (`choose_soonest`, LRU caches as in bench/router_eval.py, a pool sized to twice the
  trace's load); each prefill worker ends holding the chained hashes of the conversations it
  served, and decode worker i holds what prefill worker i holds (the pair served them).
- Filler: blocks no prompt asks for, per worker, up to B indexed blocks across the fleet.
- Loads: each worker's registry fields, fixed per worker (seeded), static during a run.
The rest of the trace (`probes`) is what placements are asked for, in order, cycled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from bench.router_eval import BLOCK_TOKENS, TRACE, Request, SimWorker, load_trace
from pdserve.services.router.policy import PrefillCandidate, choose_soonest
from pdserve.shared.hashing import block_hashes

BLOCK = 16                    # engine block size, in tokens
MODEL = "scale-sim"           # model name and KV fingerprint of the simulated workers
TOKEN_LO, TOKEN_SPAN = 1000, 29000
TRACE_BLOCKS = 25_000         # trace blocks held by each pool (prefill, decode) at most


@dataclass(frozen=True)
class Probe:
    index: int                # row of the trace
    tokens: list[int]         # the prompt
    hashes: list[int]         # chained hashes of its full blocks (what the router looks up)


@dataclass
class FleetWorker:
    index: int                # 0..W-1: its filler hashes are its own
    worker_id: str
    role: str                 # "prefill" or "decode"
    cached: list[int]         # chained hashes of the trace blocks in its prefix cache
    load: dict                # static registry fields (WorkerInfo's names)


@cache
def block_tokens(hash_id: int) -> tuple[int, ...]:
    """The BLOCK tokens standing for one trace hash id (the same wherever the id appears)."""
    return tuple(TOKEN_LO + ((hash_id * BLOCK + j) * 0x9E3779B97F4A7C15 >> 17) % TOKEN_SPAN for j in range(BLOCK))


def prompt(hash_ids: list[int]) -> list[int]:
    return [t for h in hash_ids for t in block_tokens(h)] + [TOKEN_LO]


def assign_history(requests: list[Request], workers: int, capacity: int) -> list[list[int]]:
    """Replay `requests` through the cost policy over `workers` LRU caches of `capacity`
    blocks; each worker's cached hash ids, oldest first."""
    span = max(requests[-1].t - requests[0].t, 1.0)
    tokens_per_s = 2 * sum(r.prompt_tokens for r in requests) / span / workers
    pool = [SimWorker(f"{i}", capacity) for i in range(workers)]
    for r in requests:
        candidates = [PrefillCandidate(w.worker_id, min(w.cached_blocks(r.hash_ids) * BLOCK_TOKENS, r.prompt_tokens),
                                       int(max(0.0, w.busy_until - r.t) * tokens_per_s), tokens_per_s, len(w.blocks))
                      for w in pool]
        best, _ = choose_soonest(candidates, r.prompt_tokens)
        assert best is not None  # (the pool has workers)
        pool[int(best.worker_id)].run(r, r.t, tokens_per_s)
    return [list(w.blocks) for w in pool]


def static_load(role: str, index: int) -> dict:
    """A worker's registry fields, fixed for the run: a busy but healthy fleet."""
    rng = random.Random(index)
    if role == "prefill":
        return {"total_blocks": 16384, "free_blocks": rng.randint(8000, 16000), "running": rng.randint(0, 4),
                "waiting": rng.randint(0, 8), "queued_tokens": rng.randint(0, 4000),
                "prefill_tokens_per_s": float(rng.randint(15000, 25000))}
    return {"total_blocks": 16384, "free_blocks": rng.randint(4000, 12000), "growth_blocks": rng.randint(200, 2000),
            "running": rng.randint(8, 48), "waiting": rng.randint(0, 2),
            "prefill_tokens_per_s": float(rng.randint(15000, 25000))}


@dataclass
class Trace:
    requests: list[Request]
    ids: dict[int, int]       # trace hash id -> chained block hash
    probes: list[Probe]       # the rows after the history, as prompts
    history: int              # rows replayed into the caches


def read_trace(path: Path = TRACE, history: float = 0.5) -> Trace:
    requests = load_trace(path)
    split = int(len(requests) * history)
    ids: dict[int, int] = {}    # an id always follows the same prefix in the trace: one chained hash
    probes = []
    for i, r in enumerate(requests):
        tokens = prompt(r.hash_ids)
        hashes = block_hashes(tokens[:-1], BLOCK)
        for h, c in zip(r.hash_ids, hashes):
            ids.setdefault(h, c)
        if i >= split:
            probes.append(Probe(i, tokens, hashes))
    return Trace(requests, ids, probes, split)


def make_plan(trace: Trace, workers: int, trace_blocks: int = TRACE_BLOCKS) -> list[FleetWorker]:
    """W workers: W/2 prefill, W/2 decode (decode i paired with prefill i)."""
    pairs = max(1, workers // 2)
    held = assign_history(trace.requests[:trace.history], pairs, max(1, trace_blocks // pairs))
    fleet: list[FleetWorker] = []
    for role in ("prefill", "decode"):
        for i, hash_ids in enumerate(held):
            index = len(fleet)
            fleet.append(FleetWorker(index, f"{role}-{i}", role, [trace.ids[h] for h in hash_ids],
                                     static_load(role, index)))
    return fleet


def filler_counts(total_blocks: int, workers: list[FleetWorker]) -> list[int]:
    """Filler blocks per worker so that the fleet indexes `total_blocks` in all (evenly spread)."""
    extra = max(0, total_blocks - sum(len(w.cached) for w in workers))
    share, rest = divmod(extra, len(workers))
    return [share + (i < rest) for i in range(len(workers))]


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def filler(worker: int, start: int, stop: int) -> list[int]:
    """Hashes start..stop-1 of one worker's filler: splitmix64 of (worker, n), distinct across
    workers and (but for 2^-64 odds) from every prompt's blocks."""
    with np.errstate(over="ignore"):
        z = (np.uint64(worker) << np.uint64(40)) + np.arange(start, stop, dtype=np.uint64) + _MIX[0]
        z = (z ^ (z >> np.uint64(30))) * _MIX[1]
        z = (z ^ (z >> np.uint64(27))) * _MIX[2]
        return (z ^ (z >> np.uint64(31))).tolist()
