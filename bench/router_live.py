"""Prefix-aware vs round-robin prefill choice on the live stack, side by side: `make bench-router`.

    python -m bench.router_live [--requests 24] [--interval 1.0] [--rounds 1]

Workload: 6 long system prompts (~430 tokens with the question) shared by all requests, each
request one of them plus a short question, arriving every `--interval` seconds (open loop,
same seeded sequence for both). Stack: 2 prefill workers whose KV pools (72 blocks)
hold about 2.4 of the system prompts each — 40% of them, 80% of a worker's half — and 1 decode
worker. The same requests run against PD_PREFILL_CHOICE=soonest
and =round_robin, alternating `--rounds` times; time to first token is measured by the client
(first streamed content). Prints p50/p90 per prefill choice and their ratio; writes
bench/results/router_live.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.local.stack import Stack, StackConfig

MODEL = "SmolLM2-135M-Instruct"
RESULTS = Path(__file__).parent / "results" / "router_live.json"
TOPICS = ["lighthouse keepers", "orchard growers", "ferry pilots", "bell founders", "salt traders", "clock makers"]


def system_prompt(topic: str) -> str:
    return f"You answer questions from the guild of {topic}. " + " ".join(
        f"Rule {i}: a member of the {topic} guild who serves {i + 2} years earns {i * 11} marks." for i in range(16))


def workload(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [[{"role": "system", "content": system_prompt(rng.choice(TOPICS))},
             {"role": "user", "content": f"Question {i}: what does rule {rng.randrange(16)} say?"}] for i in range(n)]


async def run_load(url: str, requests: list[list[dict]], interval: float) -> list[float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def one(i: int, messages) -> float:
            await asyncio.sleep(i * interval)
            start = time.perf_counter()
            async with http.stream("POST", "/v1/chat/completions", json={
                    "model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and any(c["delta"].get("content") for c in
                                                          json.loads(line[6:])["choices"]):
                        return time.perf_counter() - start
            raise RuntimeError("no token streamed")
        return list(await asyncio.gather(*(one(i, m) for i, m in enumerate(requests))))


def measure(choice: str, requests, interval: float) -> list[float]:
    with tempfile.TemporaryDirectory() as logs:
        cfg = StackConfig.on_free_ports(prefill=2, decode=1, kv_blocks=1024, prefill_kv_blocks=72,
                                        log_dir=Path(logs), env={"PD_PREFILL_CHOICE": choice})
        with Stack(cfg) as stack:
            warm = [[{"role": "user", "content": "Hello."}]] * 4   # first passes of every worker, tiny prompt
            asyncio.run(run_load(stack.url, warm, 0.5))
            return asyncio.run(run_load(stack.url, requests, interval))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    requests = workload(args.requests)
    ttft: dict[str, list[float]] = {"soonest": [], "round_robin": []}
    for _ in range(args.rounds):
        for choice in ttft:
            ttft[choice] += measure(choice, requests, args.interval)
    stats = {p: {"p50_s": statistics.median(v), "p90_s": sorted(v)[int(0.9 * len(v))], "n": len(v)}
             for p, v in ttft.items()}
    summary = {"ttft_p50_soonest_s": stats["soonest"]["p50_s"], "ttft_p50_round_robin_s": stats["round_robin"]["p50_s"],
               "round_robin_over_soonest_p50": stats["round_robin"]["p50_s"] / stats["soonest"]["p50_s"]}
    print(f"{args.requests} requests, one every {args.interval:g} s, {len(TOPICS)} shared system prompts of ~430 "
          f"tokens, 2 prefill workers (72 KV blocks each) + 1 decode worker, {args.rounds} round(s)")
    for p, st in stats.items():
        print(f"{p:>12}: TTFT p50 {st['p50_s'] * 1e3:7.0f} ms  p90 {st['p90_s'] * 1e3:7.0f} ms")
    print(f"round-robin / soonest, p50: {summary['round_robin_over_soonest_p50']:.2f} (target >= 2)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"summary": summary, "stats": stats, "ttft_s": ttft, "config": vars(args)}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
