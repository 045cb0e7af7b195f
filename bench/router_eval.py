"""Replay a real trace through prefill choices, the router's and baselines: `make eval-router`.

    python -m bench.router_eval [--trace bench/data/mooncake_conversation.jsonl.gz]
                                [--workers 4] [--cache-blocks 8192] [--tokens-per-s 16000]

The Mooncake conversation trace (one hour, 12,031 requests) gives each prompt as `hash_ids`,
one id per 512-token block, equal ids meaning the same prefix block. Replayed at scale 1 (the
trace's own lengths, 512-token blocks) against simulated prefill workers: each keeps an LRU
prefix cache of `--cache-blocks` blocks and computes the uncached part of each prompt at
`--tokens-per-s`, one prompt after another. Prefill choices ("policies" in router.json), all
choosing with the router's pure functions where they have any:
  ours         pdserve/services/router/policy.py choose_soonest: lowest predicted first-token
               time ((queued + uncached prompt tokens) / rate) plus the recompute weight x the
               time spent recomputing tokens another worker holds
  round_robin  worker i mod N
  random       uniform, seeded
  oracle       one cache of unlimited size (an upper bound no prefill choice can beat)
  pooled       one LRU cache as big as all workers' together: what any prefill choice over
               these LRU caches can reach at best (it never holds a block twice)
Prints hit rates (prompt tokens served from a prefix cache / all prompt tokens) and the
simulated time to first token (queue + compute), for three cache sizes and a sweep of the
recompute weight; writes bench/results/router.json (its `summary`: the chosen size).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.planner.workloads import text
from pdserve.services.router.policy import PrefillCandidate, choose_soonest

BLOCK_TOKENS = 512
TRACE = Path(__file__).parent / "data" / "mooncake_conversation.jsonl.gz"   # bench/data/README.md
RESULTS = Path(__file__).parent / "results" / "router.json"


@dataclass
class Request:
    t: float                  # arrival, seconds from the start
    prompt_tokens: int
    hash_ids: list[int]


@dataclass
class SimWorker:
    worker_id: str
    capacity: int
    blocks: OrderedDict = field(default_factory=OrderedDict)   # LRU prefix cache, oldest first
    busy_until: float = 0.0

    def cached_blocks(self, hash_ids: list[int]) -> int:
        n = 0
        for h in hash_ids:
            if h not in self.blocks:
                break
            n += 1
        return n

    def run(self, req: Request, now: float, tokens_per_s: float) -> tuple[int, float]:
        """Prefill `req` here: (cached tokens, time to first token)."""
        cached = cached_tokens(self.cached_blocks(req.hash_ids), req.prompt_tokens)
        start = max(now, self.busy_until)
        self.busy_until = start + (req.prompt_tokens - cached) / tokens_per_s
        for h in req.hash_ids:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return cached, self.busy_until - now


def cached_tokens(blocks: int, prompt_tokens: int) -> int:
    return min(blocks * BLOCK_TOKENS, prompt_tokens)


def load_trace(path: Path) -> list[Request]:
    with text(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Request(r["timestamp"] / 1000, r["input_length"], r["hash_ids"]) for r in rows]


def replay(requests: list[Request], policy: str, workers: int, cache_blocks: int, tokens_per_s: float,
           recompute_weight: float = 8.0, seed: int = 0) -> dict:
    pool = [SimWorker(f"prefill-{i}", cache_blocks) for i in range(workers)]
    rng = random.Random(seed)
    hit = total = 0
    ttft = []
    for i, req in enumerate(requests):
        if policy == "round_robin":
            w = pool[i % workers]
        elif policy == "random":
            w = rng.choice(pool)
        else:
            candidates = [PrefillCandidate(w.worker_id, cached_tokens(w.cached_blocks(req.hash_ids), req.prompt_tokens),
                                           int(max(0.0, w.busy_until - req.t) * tokens_per_s), tokens_per_s,
                                           len(w.blocks))
                          for w in pool]
            best, _ = choose_soonest(candidates, req.prompt_tokens, recompute_weight)
            assert best is not None  # (the pool has workers)
            w = next(x for x in pool if x.worker_id == best.worker_id)
        cached, first = w.run(req, req.t, tokens_per_s)
        hit, total = hit + cached, total + req.prompt_tokens
        ttft.append(first)
    ttft.sort()
    return {"hit_rate": hit / total, "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * len(ttft))],
            "prefill_tokens": total - hit}


def oracle(requests: list[Request]) -> dict:
    seen: set[int] = set()
    hit = total = 0
    for req in requests:
        n = 0
        for h in req.hash_ids:
            if h not in seen:
                break
            n += 1
        seen.update(req.hash_ids)
        hit, total = hit + cached_tokens(n, req.prompt_tokens), total + req.prompt_tokens
    return {"hit_rate": hit / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--cache-blocks", type=int, default=8192, help="per worker, in 512-token blocks")
    ap.add_argument("--tokens-per-s", type=float, default=16000, help="prefill rate per worker")
    args = ap.parse_args()
    if not args.trace.exists():
        raise SystemExit(f"no trace at {args.trace} (bench/data/README.md lists the traces)")
    requests = load_trace(args.trace)
    run = lambda name, cache=args.cache_blocks, weight=8.0: replay(  # noqa: E731
        requests, name, args.workers, cache, args.tokens_per_s, weight)
    results = {name: run(name) for name in ("ours", "round_robin", "random")}
    results["oracle"] = oracle(requests)
    pooled = replay(requests, "ours", 1, args.cache_blocks * args.workers, args.tokens_per_s * args.workers)
    results["pooled"] = {"hit_rate": pooled["hit_rate"]}   # its queueing is not the pool's: hit rate only
    summary = {f"hit_rate_{name}": r["hit_rate"] for name, r in results.items()}
    summary["ours_over_oracle"] = summary["hit_rate_ours"] / summary["hit_rate_oracle"]
    summary["ours_over_round_robin"] = summary["hit_rate_ours"] / summary["hit_rate_round_robin"]
    summary["ours_over_pooled"] = summary["hit_rate_ours"] / summary["hit_rate_pooled"]
    sizes = {size: {name: run(name, cache=size) for name in ("ours", "round_robin")}
             for size in (args.cache_blocks // 2, args.cache_blocks * 2)}
    weights = {w: run("ours", weight=w) for w in (0.0, 1.0, 4.0, 8.0, 16.0, 64.0)}

    print(f"{args.trace.name}: {len(requests)} requests at scale 1 (512-token blocks), {args.workers} prefill "
          f"workers, {args.cache_blocks} cached blocks each, {args.tokens_per_s:g} prefill tokens/s each")
    print(f"{'policy':>12} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p90':>9}")
    for name, r in results.items():
        extra = f"{r['ttft_p50_s']:8.2f}s {r['ttft_p90_s']:8.2f}s" if "ttft_p50_s" in r else f"{'-':>9} {'-':>9}"
        print(f"{name:>12} {r['hit_rate']:9.3f} {extra}")
    for size, r in sizes.items():
        print(f"  {size} blocks per worker: ours {r['ours']['hit_rate']:.3f} "
              f"(TTFT p50 {r['ours']['ttft_p50_s']:.2f}s), "
              f"round-robin {r['round_robin']['hit_rate']:.3f} ({r['round_robin']['ttft_p50_s']:.2f}s)")
    print("  recompute weight: " + ", ".join(f"{w:g} -> {r['hit_rate']:.3f} / p50 {r['ttft_p50_s']:.3f}s"
                                          f" / p90 {r['ttft_p90_s']:.2f}s" for w, r in weights.items()))
    print(f"ours / oracle {summary['ours_over_oracle']:.3f} (target >= 0.9; a pooled LRU of the same total size "
          f"reaches {summary['hit_rate_pooled'] / summary['hit_rate_oracle']:.3f}, ours is "
          f"{summary['ours_over_pooled']:.3f} of it); ours / round-robin {summary['ours_over_round_robin']:.2f} "
          "(target >= 2)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"summary": summary, "config": {**vars(args), "trace": args.trace.name,
                                                                  "scale": 1, "block_tokens": BLOCK_TOKENS},
                                   "policies": results, "cache_sizes": sizes,
                                   "recompute_weights": weights}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
