"""Throughput with tracing on against tracing off, side by side in one run.

    python -m bench.tracing_overhead [--rounds 4] [--concurrency 16] [--tokens 32]

Starts two identical stacks (1 prefill + 1 decode worker each): one exporting every span over
OTLP/HTTP to a receiver in this process, one without an endpoint (spans made and dropped).
Then alternates rounds of the same load on each — `concurrency` streamed requests of
`tokens` greedy tokens — so drift on a shared machine hits both arms alike. Throughput =
output tokens / wall time of a round. Prints both and the ratio (target ≥ 0.97) and writes
bench/results/tracing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.tools.otlp_sink import OtlpReceiver

MODEL = "SmolLM2-135M-Instruct"


async def round_(url: str, concurrency: int, tokens: int, tag: str) -> tuple[int, float]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        async def one(i: int) -> int:
            body = {"model": MODEL, "prompt": f"Request {tag}-{i}: write about rivers and hills.", "stream": True,
                    "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
            n = 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        n += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
            return n
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
        return sum(counts), time.perf_counter() - start


@contextlib.contextmanager
def started(configs: dict[str, StackConfig]) -> Iterator[dict[str, Stack]]:
    """Each arm's stack, started; all of them stopped after."""
    stacks = {name: Stack(cfg) for name, cfg in configs.items()}
    try:
        for s in stacks.values():
            s.start()
        yield stacks
    finally:
        for s in stacks.values():
            s.stop()


def side_by_side(stacks: dict[str, Stack], args: argparse.Namespace, what: str) -> dict[str, float]:
    """Rounds of the same load on each arm's stack in turn (the order alternating), after a
    warm-up round each: output tokens per second of wall time, by arm."""
    totals = {name: [0, 0.0] for name in stacks}
    for name, s in stacks.items():   # warm-up round each, not counted
        asyncio.run(round_(s.url, 4, 4, f"warm-{name}"))
    for r in range(args.rounds):
        for name in list(stacks) if r % 2 == 0 else list(reversed(stacks)):
            n, secs = asyncio.run(round_(stacks[name].url, args.concurrency, args.tokens, f"{r}"))
            totals[name][0] += n
            totals[name][1] += secs
            print(f"round {r} {what} {name:3}: {n} tokens in {secs:.2f} s = {n / secs:.1f} tok/s", flush=True)
    return {name: n / secs for name, (n, secs) in totals.items()}


def load_args(doc: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--ttft", type=int, default=40, help="(bench.tls_overhead) requests timed to the first token")
    return ap.parse_args()


def main() -> None:
    args = load_args(__doc__)
    sink = OtlpReceiver()
    arms = {"off": {}, "on": {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url}}
    try:
        with started({name: StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=1024, threads=1, env=env)
                      for name, env in arms.items()}) as stacks:
            tput = side_by_side(stacks, args, "tracing")
    finally:
        sink.close()
    ratio = tput["on"] / tput["off"]
    spans = len(sink.spans)
    print(f"\nthroughput tracing off {tput['off']:.1f} tok/s, on {tput['on']:.1f} tok/s ({spans} spans received): "
          f"on/off = {ratio:.3f} (target >= 0.97)")
    out = {"machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
           "load": vars(args), "tokens_per_s": tput, "spans_exported": spans,
           "summary": {"throughput_tracing_on_over_off": round(ratio, 4)}}
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/tracing.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
