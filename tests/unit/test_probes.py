"""/health and /ready beside /metrics on a router's or worker's metrics port (pdserve/shared/probes.py):
ready only between serving and draining, live while the event loop stamps, metrics unchanged."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

from pdserve.local.servers import free_port
from pdserve.shared import metrics
from pdserve.shared.probes import PROBES, STUCK_S, Probes


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_ready_between_serving_and_draining_live_while_the_loop_turns(monkeypatch):
    monkeypatch.setattr("pdserve.shared.probes.PROBES", probe := Probes())
    port = metrics.serve(free_port(), host="127.0.0.1")
    assert get(port, "/ready")[0] == 503
    probe.serving = True
    status, body = get(port, "/ready")
    assert status == 200 and json.loads(body)["ready"]
    assert get(port, "/health")[0] == 200
    probe.ticked = time.monotonic() - STUCK_S - 1       # the event loop stopped turning
    status, body = get(port, "/health")
    assert status == 503 and not json.loads(body)["live"]
    probe.draining = True
    assert get(port, "/ready")[0] == 503
    status, text = get(port, "/metrics")
    assert status == 200 and "pd_requests_total" in text


def test_the_stamp_follows_the_loop():
    async def turn():
        probe = Probes(ticked=0.0)
        task = asyncio.create_task(probe.tick())
        await asyncio.sleep(0.05)
        task.cancel()
        return probe.ticked
    assert time.monotonic() - asyncio.run(turn()) < 1
    assert PROBES.draining is False
