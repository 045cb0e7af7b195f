"""The gateway's probes and metrics on its metrics port, apart from the API (pdserve/shared/probes.py,
pdserve/services/gateway/readiness.py): the API's port serves neither, and /ready answers the verdict
judged in the background, so however many probes come, Redis does nothing for them."""

from __future__ import annotations

import time

import httpx
import redis


def test_probes_and_metrics_are_on_the_metrics_port_only(fake_stack):
    api = fake_stack.url
    for path in ("/ready", "/health", "/metrics"):
        assert httpx.get(api + path, timeout=10).status_code == 404, path
    internal = fake_stack.metrics_url("gateway", "")
    ready = httpx.get(internal + "/ready", timeout=10)
    assert ready.status_code == 200, ready.text
    assert ready.json()["ready"] and ready.json()["workers"] == {"router": 1, "prefill": 1, "decode": 1}
    assert httpx.get(internal + "/health", timeout=10).json()["live"]
    assert "pd_requests_total" in httpx.get(internal + "/metrics", timeout=10).text
    assert httpx.get(api + "/v1/models", timeout=10).status_code == 200   # the API stays where it is


def commands(store: redis.Redis) -> int:
    return sum(stat["calls"] for stat in store.info("commandstats").values())


def test_a_burst_of_a_thousand_ready_calls_makes_redis_do_nothing(fake_stack):
    """What Redis runs during the burst is what it runs as long without one (heartbeats, the routers'
    and the gateway's own registry reads): a probe that read the registry would add a command each."""
    store = redis.Redis.from_url(fake_stack.redis_url)
    with httpx.Client(timeout=10) as client:
        before, t0 = commands(store), time.monotonic()
        answers = [client.get(fake_stack.metrics_url("gateway", "/ready")).status_code for _ in range(1000)]
        burst, took_s = commands(store) - before, time.monotonic() - t0
    before = commands(store)
    time.sleep(took_s)
    idle = commands(store) - before
    assert answers == [200] * 1000
    assert burst < idle + 100 + 20 * took_s, (burst, idle, took_s)
    store.close()
