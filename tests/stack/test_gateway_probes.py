"""The gateway's probes and metrics on its metrics port, apart from the API (pdserve/shared/probes.py,
pdserve/services/gateway/readiness.py): the API's port serves neither, and /ready answers the verdict
judged in the background, so however many probes come, Redis does nothing for them."""

from __future__ import annotations

import signal
import time

import httpx
import redis
from conftest import FAKE, MODEL, fake_env

from pdserve.local.stack import Stack, StackConfig


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


def test_a_draining_gateway_answers_503_on_its_metrics_port_while_its_stream_finishes(tmp_path):
    """SIGTERM: the API's port closes to new connections, the metrics port stays open and says
    not ready (an orchestrator takes the gateway out), and the stream in flight finishes."""
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=256, threads=1, model=FAKE, log_dir=tmp_path,
                                    env=fake_env(step_s=0.05))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 40,
            "stream": True, "ignore_eos": True}
    with Stack(cfg) as stack, httpx.Client(timeout=60) as client:
        ready_url, chunks, during, lines = stack.metrics_url("gateway", "/ready"), 0, None, []
        with client.stream("POST", stack.url + "/v1/chat/completions", json=body) as r:
            for line in filter(None, r.iter_lines()):
                lines.append(line)
                chunks += line.startswith("data: {")
                if chunks == 3:
                    stack.procs["gateway"].send_signal(signal.SIGTERM)
                    time.sleep(0.3)
                    during = client.get(ready_url)
        exit_code = stack.procs["gateway"].wait(30)
    assert during is not None and during.status_code == 503 and during.json()["draining"], during
    assert lines[-1] == "data: [DONE]" and chunks > 30, lines[-3:]
    assert exit_code in (0, -signal.SIGTERM)   # (uvicorn raises the signal it caught again once it has shut down)
