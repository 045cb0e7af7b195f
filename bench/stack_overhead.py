"""Control-plane overhead: time to first token through the whole stack minus the in-process
engine's, for a short prompt, measured side by side in one run.

    python -m bench.stack_overhead [--requests 50] [--colocated]   (writes bench/results/stack.json)

Starts the local stack (1 prefill + 1 decode worker; each worker gets cores/workers torch
threads, and the in-process engine the same number), then alternates: one streamed request
through HTTP → gateway → router → decode admit → prefill (JetStream) → first token over NATS
→ SSE, and one in-process engine prefill of the same prompt. Prints p50/p99 of both and of
the difference. Targets: overhead p50 ≤ 5 ms, p99 ≤ 25 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import httpx
import torch

from deploy.local.stack import Stack, StackConfig
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.loader import load
from shared.engine.sequence import SamplingParams

MESSAGES = [{"role": "user", "content": "Hi!"}]


def stack_ttft(http: httpx.Client, model: str) -> float:
    start = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json={
            "model": model, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, "stream": True,
            "return_token_ids": True}) as r:
        ttft = None
        for line in r.iter_lines():  # read to the end: the request finishes before the next one
            if ttft is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("token_ids"):
                ttft = time.perf_counter() - start
    assert ttft is not None, "no token in the stream"
    return ttft


def engine_ttft(engine: Engine, ids: list[int], i: int) -> float:
    start = time.perf_counter()
    engine.add_request(f"b{i}", ids, SamplingParams(max_tokens=2, temperature=0), prefill_only=True)
    while not engine.step():
        pass
    ttft = time.perf_counter() - start
    engine.abort(f"b{i}")
    return ttft


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--colocated", action="store_true")
    args = ap.parse_args()
    workers = 1 if args.colocated else 2
    threads = max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)

    loaded = load("smollm2")
    engine = Engine(loaded, EngineConfig(num_blocks=256))
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(MESSAGES))
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, colocated=args.colocated, threads=threads, kv_blocks=512)
    t0 = time.monotonic()
    with Stack(cfg) as stack:
        ready_s = time.monotonic() - t0
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            for i in range(3):  # warm both paths
                stack_ttft(http, "SmolLM2-135M-Instruct"), engine_ttft(engine, ids, -i - 1)
            through, direct = [], []
            for i in range(args.requests):
                through.append(stack_ttft(http, "SmolLM2-135M-Instruct"))
                direct.append(engine_ttft(engine, ids, i))
    over = [a - b for a, b in zip(through, direct)]
    mode = "colocated" if args.colocated else "1 prefill + 1 decode"
    print(f"\nstack ({mode}) ready in {ready_s:.1f} s; prompt {len(ids)} tokens; {args.requests} requests; "
          f"{threads} torch thread(s) per worker and in-process")
    print(f"{'TTFT (ms)':24} {'p50':>8} {'p99':>8}")
    for name, xs in (("through the stack", through), ("engine in-process", direct), ("per-request difference", over)):
        print(f"{name:24} {1e3 * pct(xs, 50):8.1f} {1e3 * pct(xs, 99):8.1f}")
    print(f"{'overhead (p50 - p50)':24} {1e3 * (pct(through, 50) - pct(direct, 50)):8.1f}   target <= 5 ms")
    print(f"{'overhead (p99 - p99)':24} {1e3 * (pct(through, 99) - pct(direct, 99)):8.1f}   target <= 25 ms")
    ms = {name: {"p50": round(1e3 * pct(xs, 50), 2), "p99": round(1e3 * pct(xs, 99), 2)}
          for name, xs in (("through_stack", through), ("engine_in_process", direct), ("difference", over))}
    summary = {"overhead_p50_ms": round(1e3 * (pct(through, 50) - pct(direct, 50)), 2),
               "overhead_p99_ms": round(1e3 * (pct(through, 99) - pct(direct, 99)), 2),
               "target_p50_ms": 5.0, "target_p99_ms": 25.0}
    out = Path(__file__).parent / "results" / ("stack_colocated.json" if args.colocated else "stack.json")
    out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
                               "mode": mode, "prompt_tokens": len(ids), "requests": args.requests,
                               "threads": threads, "ttft_ms": ms, "summary": summary}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
