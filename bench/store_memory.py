"""What a request costs Redis, measured on the live stack (the fake model: the services write every
event a request makes, the model is not what is measured): the bytes of a finished request's history
(its summary and log) while it is kept, what is left of it once PD_HISTORY_S has passed (nothing, by
design), its placement record (`pd:route:{id}`, kept ROUTE_TTL_S for a repeated request: control
state), and the store's steady-state memory at the scale bench's rate from those bytes. Writes
bench/results/store.json (`make bench-store`, ~1 minute).

    python -m bench.store_memory [--requests 300] [--rate 1000] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis

from bench.scale.index_compare import machine
from pdserve.local.stack import Stack, StackConfig
from pdserve.services.router.admits import ROUTE_TTL_S
from pdserve.shared.state import GATEWAYS, log_key, request_key, route_key

HISTORY_S, DEFAULT_HISTORY_S = 5, 600.0   # the window here (short, to see it pass), and the default's


def ask(url: str, i: int) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 16, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Question {i}: what is {i} times {i + 1}?"}]})
    r.raise_for_status()
    return r.headers["x-request-id"]


def mean_bytes(store: redis.Redis, keys: list[list[str]]) -> float:
    """MEMORY USAGE of each request's keys (each a list), averaged over the requests."""
    return sum(sum(store.memory_usage(k, samples=0) or 0 for k in ks) for ks in keys) / len(keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=1000.0, help="requests/s for the steady-state figure")
    ap.add_argument("--out", type=Path, default=Path("bench/results/store.json"))
    args = ap.parse_args()
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, model="fake:smollm2",
                                    log_dir=Path(tempfile.mkdtemp(prefix="store-")),
                                    env={"PD_MODEL_NAME": "SmolLM2-135M-Instruct", "PD_HISTORY_S": str(HISTORY_S)})
    with Stack(cfg) as stack, ThreadPoolExecutor(8) as pool:
        store = redis.Redis.from_url(stack.redis_url)
        base = store.info("memory")["used_memory"]
        started = time.monotonic()
        rids = list(pool.map(lambda i: ask(stack.url, i), range(args.requests)))
        served_s = time.monotonic() - started
        time.sleep(1)                                   # the gateways' last events written
        history = [[request_key(r), log_key(r)] for r in rids]
        kept, placements = mean_bytes(store, history), mean_bytes(store, [[route_key(r)] for r in rids])
        used_kept = store.info("memory")["used_memory"] - base
        time.sleep(HISTORY_S + 2)
        left = mean_bytes(store, history)
        used_left = store.info("memory")["used_memory"] - base
        control = [k.decode() for k in store.keys("pd:*") if not k.decode().startswith(("pd:req:", "pd:route:"))]
    n = args.requests
    history_b, left_b = (used_kept - used_left) / n, used_left / n   # Redis's own count (used_memory)
    summary = {
        "requests": n, "served_per_s": round(n / served_s, 1),
        "bytes_per_request_kept": round(used_kept / n), "history_bytes_per_request": round(history_b),
        "history_bytes_per_request_after_the_window": left,            # MEMORY USAGE of its keys then: 0
        "bytes_per_request_after_the_window": round(left_b),           # its placement record, until ROUTE_TTL_S
        "memory_usage_history_bytes": round(kept), "memory_usage_placement_bytes": round(placements),
        "placement_kept_s": ROUTE_TTL_S, "rate_per_s": args.rate, "default_history_s": DEFAULT_HISTORY_S,
        "steady_state_mb_at_rate": round(args.rate * (history_b * DEFAULT_HISTORY_S + left_b * ROUTE_TTL_S) / 2**20),
        "control_keys_after": sorted(k for k in control if k != GATEWAYS)[:20],
    }
    out = {"machine": machine(), "summary": summary}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
