"""The prefix index side by side: Redis (pdserve/shared/prefix_index.py, PD_PREFIX_INDEX=redis) and the
router's memory (pdserve/services/router/prefix_memory.py through prefix_feeds.py, =events).

    python -m bench.scale.index_compare [--workers 4,64,256] [--blocks 1000000,10000000]
                                        [--lookups 2000] [--updates 300]

Per (W workers, B indexed blocks), with a real redis-server: each worker caches a shared
16-block system prompt and (B - 16) / W blocks of its own, in chains of 64. The same caches go
into Redis (each bucket as the workers' update script leaves it, written with HSET: the script
itself would take minutes at 10M blocks) and into a memory index (each worker's cache as a
snapshot). Then, for both:
- lookups: prompts of 128 blocks (the shared prefix, a random worker's chain for 0-112 blocks,
  then blocks nobody holds); µs per lookup as a placement waits for it (Redis: the round trip
  with its parse; memory: the call), and Redis's own µs per script call (INFO commandstats);
- updates: one engine step's worth for a random worker (32 blocks stored, 32 evicted); Redis:
  the script's round trip and its own time; memory: the PrefixEvents message decoded and applied;
- writing a whole cache: Redis's own time per 4,096-hash script call (each holds every other
  client up), the memory index's µs per block of a snapshot taken in;
- memory: Redis's used_memory and the router process's RSS grown per block, and the memory
  index's own structures (its dict's table plus the hash objects) per block.
Writes bench/results/prefix_index_compare.json (machine, config, runs, summary).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import uvloop
from redis.asyncio.client import Pipeline

from bench.machine import cpu_model
from bench.scale import index_readme
from pdserve.local.servers import free_port, valkey_server, wait_for_port
from pdserve.services.router.prefix_feeds import Feeds, Snapshot
from pdserve.services.router.prefix_memory import MemoryIndex
from pdserve.shared import prefix_index
from pdserve.shared.messages import PrefixEvents
from pdserve.shared.state import State

RESULT = Path(__file__).parents[1] / "results" / "prefix_index_compare.json"
SHARED, CHAIN, PROMPT, STEP = 16, 64, 128, 32
NOTES = ("One process times both (the router's side and Redis's client), on the machine named; percentiles "
         "move with whatever else runs there. Redis is filled with HSET (each bucket as the update script "
         "writes it); its script is timed on 4,096-hash calls on top (fill_call_server_ms). Bytes per block: "
         "*_mb_per_million_blocks (1 byte per block = 1 MB per million blocks).")
FILL_CALLS = 20    # update-script calls of 4,096 hashes timed (a worker writing its whole cache)


def rss_bytes() -> int:
    for ln in Path("/proc/self/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) * 1024
    return 0


def pct(xs: list[float]) -> dict:
    a = np.asarray(xs)
    return {"p50": round(float(np.percentile(a, 50)), 2), "p99": round(float(np.percentile(a, 99)), 2),
            "mean": round(float(a.mean()), 2)}


class Fleet:
    """The caches of one (W, B) point, and the prompts and updates asked of both indexes."""

    def __init__(self, workers: int, blocks: int, seed: int = 1):
        self.workers, self.blocks = workers, blocks
        self.rng = np.random.default_rng(seed)
        self.shared = self.fresh(SHARED)
        per_worker = (blocks - SHARED) // workers
        self.own = [self.rng.integers(0, 2**64, per_worker, dtype=np.uint64) for _ in range(workers)]

    def fresh(self, n: int) -> list[int]:
        """Block hashes nobody holds (random 64-bit, as chained hashes look)."""
        return self.rng.integers(0, 2**64, n, dtype=np.uint64).tolist()

    def cache(self, w: int) -> list[int]:
        return self.shared + self.own[w].tolist()

    def prompts(self, n: int) -> list[list[int]]:
        out = []
        for _ in range(n):
            own = self.own[int(self.rng.integers(self.workers))]
            chain = int(self.rng.integers(max(1, len(own) // CHAIN))) * CHAIN
            held = min(int(self.rng.integers(0, PROMPT - SHARED + 1)), CHAIN)
            prompt = self.shared + own[chain:chain + held].tolist()
            out.append(prompt + self.fresh(PROMPT - len(prompt)))
        return out

    def updates(self, n: int) -> list[tuple[int, list[int], list[int]]]:
        """(worker, stored, evicted): new blocks stored, some of its own evicted."""
        out = []
        for _ in range(n):
            w = int(self.rng.integers(self.workers))
            out.append((w, self.fresh(STEP), self.own[w][self.rng.integers(0, len(self.own[w]), STEP)].tolist()))
        return out


def memory_side(fleet: Fleet, prompts: list[list[int]], updates: list) -> dict:
    """The memory index: filled from snapshots, looked up, updated from decoded messages."""
    gc.collect()
    rss0, index = rss_bytes(), MemoryIndex()
    feeds, fill_s = Feeds(index, gone_s=60), 0.0
    for w in range(fleet.workers):
        hashes = fleet.cache(w)
        feeds.on_events(PrefixEvents(worker_id=f"w{w}", epoch="e", first=0, last=0))
        t = time.perf_counter()
        feeds.on_snapshot(Snapshot(f"w{w}", "e", 0, hashes))
        fill_s += time.perf_counter() - t
    gc.collect()
    grown = rss_bytes() - rss0
    structural = sys.getsizeof(index.blocks) + sum(sys.getsizeof(h) for h in list(index.blocks)[:100_000]) \
        * len(index) / min(len(index), 100_000)
    lookups = []
    for hashes in prompts:
        t = time.perf_counter_ns()
        index.lookup(hashes)
        lookups.append((time.perf_counter_ns() - t) / 1e3)
    seqs, applied = dict.fromkeys(range(fleet.workers), 0), []
    for w, stored, evicted in updates:
        raw = PrefixEvents(worker_id=f"w{w}", epoch="e", first=seqs[w], last=seqs[w] + 2 * STEP,
                           added=stored, removed=evicted).encode()
        seqs[w] += 2 * STEP
        t = time.perf_counter_ns()
        feeds.on_events(PrefixEvents.decode(raw))
        applied.append((time.perf_counter_ns() - t) / 1e3)
    assert feeds.applied == len(updates) and not feeds.awaiting()
    out = {"indexed_blocks": len(index), "lookup_us": pct(lookups), "update_us": pct(applied),
           "snapshot_us_per_block": round(1e6 * fill_s / fleet.blocks, 3),
           "rss_bytes_per_block": round(grown / fleet.blocks, 1),
           "structural_bytes_per_block": round(structural / fleet.blocks, 1)}
    del feeds, index
    gc.collect()
    return out


async def redis_side(state: State, fleet: Fleet, prompts: list[list[int]], updates: list) -> dict:
    """The Redis index: filled as the workers' update script leaves it, looked up, updated with
    the script; the script's time on fill-sized calls (4,096 hashes) measured on top."""
    await state.call(lambda p: p.flushall())
    used0 = (await state.call(lambda p: p.info("memory")))["used_memory"]
    pubs = [prefix_index.PrefixPublisher(state, f"w{w}", lease_s=3600) for w in range(fleet.workers)]
    for pub in pubs:
        await pub._new_slot()  # (no lease task: nothing else runs against this Redis)
    t = time.perf_counter()
    await fill(state, fleet, [pub.slot for pub in pubs])
    fill_s = time.perf_counter() - t
    used = (await state.call(lambda p: p.info("memory")))["used_memory"] - used0
    await reset_stats(state)
    lookups = []
    for hashes in prompts:
        t0 = time.perf_counter_ns()
        await prefix_index.lookup(state, hashes)
        lookups.append((time.perf_counter_ns() - t0) / 1e3)
    lookup_calls = await script_stats(state)
    await reset_stats(state)
    applied = []
    for w, stored, evicted in updates:
        t0 = time.perf_counter_ns()
        await pubs[w]._apply(stored, evicted)
        applied.append((time.perf_counter_ns() - t0) / 1e3)
    update_calls = await script_stats(state)
    await reset_stats(state)
    for _ in range(FILL_CALLS):  # a worker writing its whole cache (a new slot, a resync): full calls
        await pubs[int(fleet.rng.integers(fleet.workers))]._apply(fleet.fresh(prefix_index.UPDATE_CHUNK), [])
    fill_calls = await script_stats(state)
    return {"lookup_us": pct(lookups), "lookup_server_us": lookup_calls["usec_per_call"],
            "update_us": pct(applied), "update_server_us": update_calls["usec_per_call"],
            "fill_s": round(fill_s, 1), "fill_call_server_ms": round(fill_calls["usec_per_call"] / 1e3, 2),
            "used_memory_bytes_per_block": round(used / fleet.blocks, 1)}


async def fill(state: State, fleet: Fleet, slots: list[int]) -> None:
    """Every bucket as the update script leaves it (each block's field: its holders' slots,
    comma-separated), written with HSET a thousand buckets a round trip: far quicker than the
    script at 10M blocks, which is timed on its own (`FILL_CALLS`)."""
    hashes = np.concatenate(fleet.own)
    holder = np.repeat(np.arange(fleet.workers), [len(o) for o in fleet.own])
    buckets = (hashes % np.uint64(prefix_index.BUCKETS)).astype(np.int64)
    order = np.argsort(buckets, kind="stable")
    fields, holder = hashes.view(np.int64)[order].tolist(), holder[order].tolist()
    edges = np.searchsorted(buckets[order], np.arange(prefix_index.BUCKETS + 1)).tolist()
    del hashes, buckets, order
    names, everyone = [str(s) for s in slots], ",".join(str(s) for s in slots)
    shared: dict[int, dict[int, str]] = {}
    for h in fleet.shared:
        shared.setdefault(h % prefix_index.BUCKETS, {})[prefix_index.field(h)] = everyone

    def bucket_fields(b: int) -> dict[int, str]:
        a, z = edges[b], edges[b + 1]
        return {**{f: names[k] for f, k in zip(fields[a:z], holder[a:z])}, **shared.get(b, {})}

    def write(start: int) -> Callable[[Pipeline], None]:
        def build(p: Pipeline) -> None:
            for b in range(start, start + 1024):
                if m := bucket_fields(b):
                    p.hset(prefix_index.bucket(b), mapping=m)
        return build

    for start in range(0, prefix_index.BUCKETS, 1024):
        await state.pipelined(write(start))


async def reset_stats(state: State) -> None:
    await state.call(lambda p: p.config_resetstat())


async def script_stats(state: State) -> dict:
    """evalsha's calls and µs per call since the last reset (Redis's own time, not the round trip)."""
    stats = await state.call(lambda p: p.info("commandstats"))
    got = stats.get("cmdstat_evalsha", {"calls": 0, "usec_per_call": 0.0})
    return {"calls": int(got["calls"]), "usec_per_call": round(float(got["usec_per_call"]), 1)}


async def point(state: State, workers: int, blocks: int, args: argparse.Namespace) -> dict:
    fleet = Fleet(workers, blocks)
    prompts, updates = fleet.prompts(args.lookups), fleet.updates(args.updates)
    t = time.monotonic()
    memory = memory_side(fleet, prompts, updates)
    redis = await redis_side(state, fleet, prompts, updates)
    row = {"workers": workers, "blocks": blocks, "memory": memory, "redis": redis,
           "seconds": round(time.monotonic() - t, 1)}
    print(f"W={workers} B={blocks:,}: lookup p50/p99 µs redis {redis['lookup_us']['p50']}/{redis['lookup_us']['p99']}"
          f" memory {memory['lookup_us']['p50']}/{memory['lookup_us']['p99']}; update p50 µs redis "
          f"{redis['update_us']['p50']} memory {memory['update_us']['p50']}; bytes/block redis "
          f"{redis['used_memory_bytes_per_block']} memory {memory['rss_bytes_per_block']} ({row['seconds']} s)",
          flush=True)
    return row


def summary(runs: list[dict]) -> dict:
    def key(r: dict) -> str:
        return f"w{r['workers']}_b{r['blocks'] / 1e6:g}m"

    def each(side: str, *path: str) -> dict:
        out = {}
        for r in runs:
            v = r[side]
            for p in path:
                v = v[p]
            out[key(r)] = v
        return out

    largest = max(runs, key=lambda r: (r["blocks"], r["workers"]))
    return {
        "lookup_p50_us": {"redis": each("redis", "lookup_us", "p50"), "memory": each("memory", "lookup_us", "p50")},
        "lookup_p99_us": {"redis": each("redis", "lookup_us", "p99"), "memory": each("memory", "lookup_us", "p99")},
        "redis_lookup_server_us": each("redis", "lookup_server_us"),
        "update_p50_us": {"redis": each("redis", "update_us", "p50"), "memory": each("memory", "update_us", "p50")},
        "redis_update_server_us": each("redis", "update_server_us"),
        "redis_fill_call_server_ms": each("redis", "fill_call_server_ms"),
        "memory_snapshot_us_per_block": each("memory", "snapshot_us_per_block"),
        "router_mb_per_million_blocks": {"rss": round(largest["memory"]["rss_bytes_per_block"], 1),
                                         "structural": round(largest["memory"]["structural_bytes_per_block"], 1),
                                         "at": key(largest)},
        "redis_mb_per_million_blocks": {"used_memory": round(largest["redis"]["used_memory_bytes_per_block"], 1),
                                        "at": key(largest)},
        "lookup_p50_speedup": {k: round(each("redis", "lookup_us", "p50")[k] / max(v, 1e-9), 1)
                               for k, v in each("memory", "lookup_us", "p50").items()},
    }


def machine() -> dict:
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
            "python": platform.python_version()}


async def main_async(args: argparse.Namespace) -> dict:
    t0, port = time.monotonic(), free_port()
    with tempfile.TemporaryDirectory() as d:
        server = subprocess.Popen([valkey_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL)
        try:
            wait_for_port(port)
            state = State.connect(f"redis://127.0.0.1:{port}/0")
            runs = [await point(state, w, b, args) for b in args.blocks for w in args.workers]
            await state.close()
        finally:
            server.terminate()
            server.wait()
    return {"machine": machine(), "notes": NOTES,
            "config": {"workers": args.workers, "blocks": args.blocks, "lookups": args.lookups,
                                             "updates": args.updates, "prompt_blocks": PROMPT,
                                             "shared_prefix_blocks": SHARED, "chain_blocks": CHAIN,
                                             "step_blocks": f"{STEP} stored + {STEP} evicted"},
            "duration_s": round(time.monotonic() - t0, 1), "runs": runs, "summary": summary(runs)}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale.index_compare", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[4, 64, 256])
    p.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[1_000_000, 10_000_000])
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--updates", type=int, default=300)
    p.add_argument("--out", type=Path, default=RESULT)
    return p.parse_args()


def main() -> None:
    args = parse()
    result = uvloop.run(main_async(args))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    if args.out == RESULT:
        index_readme.write(result)


if __name__ == "__main__":
    main()
