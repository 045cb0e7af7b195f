"""What a request costs Redis, measured on the live stack (the fake model: the services write every
event a request makes, the model is not what is measured): the bytes of a finished request's history
(its summary and log) while it is kept, what is left of it once PD_HISTORY_S has passed (nothing, by
design), its placement record (`pd:route:{id}`, kept ROUTE_TTL_S for a repeated request: control
state), the requests that ended lately (`pd:{flight}:ended`, kept ENDED_KEEP_S: control state), and the
store's steady-state memory at the scale bench's rate from those bytes. Writes bench/results/store.json
and docs/RESULTS.md's "Redis per request" block (`make bench-store`, ~1.5 minutes).

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

from bench.results_doc import RESULTS_DOC, update_block
from bench.scale.index_compare import machine
from pdserve.local.stack import Stack, StackConfig
from pdserve.services.router.admits import ROUTE_TTL_S
from pdserve.shared.state import GATEWAYS, log_key, request_key, route_key
from pdserve.shared.state.keys import ENDED, ENDED_KEEP_S

HISTORY_S, DEFAULT_HISTORY_S = 45, 600.0   # the window here (past the requests' serving, to see it pass), the default's
WARM = 16                                 # requests before the count: the services' connections and scripts
BEGIN, END = "<!-- bench:store:begin -->", "<!-- bench:store:end -->"


def ask(url: str, i: int) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 16, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Question {i}: what is {i} times {i + 1}?"}]})
    r.raise_for_status()
    return r.headers["x-request-id"]


def mean_bytes(store: redis.Redis, keys: list[list[str]]) -> float:
    """MEMORY USAGE of each request's keys (each a list), averaged over the requests."""
    return sum(sum(store.memory_usage(k, samples=0) or 0 for k in ks) for ks in keys) / len(keys)


def measure(url: str, redis_url: str, n: int) -> dict:
    """Redis's `used_memory` growth over `n` requests (past a warm-up's: its connections and scripts), and
    `MEMORY USAGE` of their keys, while their history is kept and once the window has passed."""
    store = redis.Redis.from_url(redis_url)
    with ThreadPoolExecutor(8) as pool:
        warm = list(pool.map(lambda i: ask(url, i), range(-WARM, 0)))
        time.sleep(1)                                   # the gateways' last events written
        warm_history = sum(mean_bytes(store, [[request_key(r), log_key(r)]]) for r in warm)  # (gone by the end)
        base = store.info("memory")["used_memory"]
        started = time.monotonic()
        rids = list(pool.map(lambda i: ask(url, i), range(n)))
        served_s = time.monotonic() - started
    time.sleep(1)
    if served_s + 1 >= HISTORY_S:
        raise SystemExit(f"served in {served_s:.0f} s: the first requests' history went before it was measured")
    history = [[request_key(r), log_key(r)] for r in rids]
    kept, placements = mean_bytes(store, history), mean_bytes(store, [[route_key(r)] for r in rids])
    used_kept = store.info("memory")["used_memory"] - base
    time.sleep(HISTORY_S + 2)
    return {"served_s": served_s, "kept": kept, "placements": placements, "used_kept": used_kept,
            "left": mean_bytes(store, history), "used_left": store.info("memory")["used_memory"] - base + warm_history,
            "ended": (store.memory_usage(ENDED, samples=0) or 0) / (n + WARM),   # (still within ENDED_KEEP_S)
            "control": [k.decode() for k in store.keys("pd:*")
                        if not k.decode().startswith(("pd:req:", "pd:route:")) and k.decode() != GATEWAYS]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=1000.0, help="requests/s for the steady-state figure")
    ap.add_argument("--out", type=Path, default=Path("bench/results/store.json"))
    args = ap.parse_args()
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, model="fake:smollm2",
                                    log_dir=Path(tempfile.mkdtemp(prefix="store-")),
                                    env={"PD_MODEL_NAME": "SmolLM2-135M-Instruct", "PD_HISTORY_S": str(HISTORY_S)})
    with Stack(cfg) as stack:
        m = measure(stack.url, stack.redis_url, args.requests)
    n = args.requests
    history_b, left_b = (m["used_kept"] - m["used_left"]) / n, m["used_left"] / n   # Redis's own count
    placement_b = max(left_b - m["ended"], 0.0)                                      # what stays until ROUTE_TTL_S
    summary = {
        "requests": n, "served_per_s": round(n / m["served_s"], 1), "history_s": HISTORY_S,
        "bytes_per_request_kept": round(m["used_kept"] / n), "history_bytes_per_request": round(history_b),
        "history_bytes_per_request_after_the_window": m["left"],        # MEMORY USAGE of its keys then: 0
        "bytes_per_request_after_the_window": round(left_b),            # its placement record and its end's entry
        "memory_usage_history_bytes": round(m["kept"]), "memory_usage_placement_bytes": round(m["placements"]),
        "memory_usage_ended_bytes": round(m["ended"]), "ended_kept_s": ENDED_KEEP_S,
        "placement_kept_s": ROUTE_TTL_S, "rate_per_s": args.rate, "default_history_s": DEFAULT_HISTORY_S,
        "steady_state_mb_at_rate": round(args.rate * (history_b * DEFAULT_HISTORY_S + placement_b * ROUTE_TTL_S
                                                      + m["ended"] * ENDED_KEEP_S) / 2**20),
        "control_keys_after": sorted(m["control"])[:20],
    }
    out = {"machine": machine(), "summary": summary}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    update_block(RESULTS_DOC, BEGIN, END, section(out))


def section(data: dict) -> str:
    """docs/RESULTS.md's "Redis per request" block, from store.json."""
    s, m = data["summary"], data["machine"]
    return "\n".join([
        f"Measured by `make bench-store` on {m['cpus']} CPU cores ({m.get('cpu_model', '')}): {s['requests']} chat "
        f"requests of 16 tokens through the local stack on the fake model ({s['served_per_s']:g} req/s served), "
        f"`PD_HISTORY_S` of {s['history_s']:g} s to see it pass. Redis's `used_memory` per request:", "",
        "| what | bytes / request | kept |", "|---|---|---|",
        f"| everything, while its history is kept | {s['bytes_per_request_kept']:,} | |",
        f"| its history (summary and log; `MEMORY USAGE`: {s['memory_usage_history_bytes']:,}) | "
        f"{s['history_bytes_per_request']:,} | `PD_HISTORY_S` ({s['default_history_s']:g} s by default) |",
        f"| its history once the window has passed | {s['history_bytes_per_request_after_the_window']:g} | |",
        f"| control state left then: its placement record (`MEMORY USAGE`: {s['memory_usage_placement_bytes']:,}) "
        f"and its end's entry ({s['memory_usage_ended_bytes']:,}) | {s['bytes_per_request_after_the_window']:,} | "
        f"{s['placement_kept_s']:g} s; the end's entry {s['ended_kept_s']:g} s |", "",
        f"Steady state at {s['rate_per_s']:,g} req/s with the default window: "
        f"**{s['steady_state_mb_at_rate']:,} MB**."])


if __name__ == "__main__":
    main()
