"""What the chaos scenarios read of the stack between faults: the workers' registry entries,
each request's events, the gateway's and router's counts (bench/chaos/scenarios.py)."""

from __future__ import annotations

import functools
import json
import time

import httpx

from pdserve.local.stack import Stack
from pdserve.shared.state import WORKERS, log_key, worker_key
from pdserve.shared.urls import sync_redis


@functools.cache
def client_of(url: str):
    """One client per store for the whole run (through the Sentinels on the HA stack)."""
    return sync_redis(url)


def request_events(stack: Stack, request_ids: list[str]) -> list[list[dict]]:
    """Each request's events (pdserve/shared/lifecycle.py), as recorded in Redis."""
    store = client_of(stack.redis_url)
    with store.pipeline(transaction=False) as p:
        for rid in request_ids:
            p.lrange(log_key(rid), 0, -1)
        return [[json.loads(e) for e in events] for events in p.execute()]


def pools(stack: Stack) -> dict[str, dict]:
    store = client_of(stack.redis_url)
    ids = [i.decode() for i in store.smembers(WORKERS)]
    infos = [json.loads(v) for v in store.mget([worker_key(i) for i in ids]) if v] if ids else []
    return {w["worker_id"]: w for w in infos if w["role"] in ("prefill", "decode")}


def settle(stack: Stack, expect: set[str], timeout_s: float = 45) -> dict[str, int]:
    """Blocks still taken per worker once idle (waits until every expected worker is back and empty)."""
    deadline = time.monotonic() + timeout_s
    taken: dict[str, int] = {}
    while time.monotonic() < deadline:
        now = pools(stack)
        taken = {w: now[w]["total_blocks"] - now[w]["free_blocks"] if w in now else -1 for w in expect}
        busy = any(now.get(w, {}).get("running") or now.get(w, {}).get("waiting") for w in expect)
        if not busy and all(n == 0 for n in taken.values()):
            break
        time.sleep(0.3)
    return taken


def moves(stack: Stack) -> dict[str, float]:
    """Counts from /metrics: the gateway's streams moved (failovers by why) and replayed, and
    the router's placements refused for want of room on a decode worker (a failover waits
    for a slot there)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for name, families in (("gateway", ("pd_failovers", "pd_replays")), ("router", ("pd_placements",))):
        text = httpx.get(stack.metrics_url(name), timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                continue
            for sample in family.samples:
                labels = sample.labels
                if not sample.name.endswith("_total") or labels.get("mode", "refused") != "refused":
                    continue
                why = labels.get("why") or labels.get("outcome") or labels.get("reason")
                key = f"{family.name.removeprefix('pd_')}:{why}"
                out[key] = out.get(key, 0) + sample.value
    return out
