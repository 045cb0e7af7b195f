"""Deadlines are on the store's clock (pdserve/shared/state/requests.py): a fleet's hosts' clocks differ, and the
routers' supervisor compares every request's deadline with one "now". A writer whose clock is
an hour behind or ahead sets the same deadline as one on time."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.shared.state import DEADLINES, State
from pdserve.shared.state import requests as state_module


@pytest.fixture(scope="module")
def redis_url(redis_or_cluster_url):
    """One redis-server, then a Redis Cluster (tests/integration/conftest.py)."""
    return redis_or_cluster_url


@pytest.mark.parametrize("skew_s", [-3600.0, 3600.0])
def test_a_deadline_does_not_move_with_the_writers_clock(redis_url, monkeypatch, skew_s):
    real = time.time

    async def scenario():
        store = State.connect(redis_url)
        await store.r.delete(DEADLINES)
        monkeypatch.setattr(state_module.time, "time", lambda: real() + skew_s)   # the writer's host
        await store.requests.record("slow", "decoding", deadline_s=30)
        await store.requests.record("soon", "decoding", deadline_s=0.2)
        await store.requests.progressed(["slow"], 40)
        monkeypatch.setattr(state_module.time, "time", real)                       # the supervisor's
        seconds, micros = await store.r.time()
        score = await store.r.zscore(DEADLINES, "slow")
        await asyncio.sleep(0.4)
        overdue = await store.requests.overdue()
        await store.close()
        return score - (seconds + micros / 1e6), overdue

    ahead_s, overdue = asyncio.run(scenario())
    assert 39 < ahead_s <= 40.5          # 40 s from the store's now, whatever the writer's clock says
    assert overdue == ["soon"]
