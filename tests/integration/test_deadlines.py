"""Deadlines are on the store's clock (pdserve/shared/state/requests.py): a fleet's hosts' clocks differ, and the
routers' supervisor compares every request's deadline with one "now". A writer whose clock is
an hour behind or ahead sets the same deadline as one on time. A push adds again a deadline that a
Redis restarted empty lost, never one of a request that ended."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.shared.state import DEADLINES, State
from pdserve.shared.state import requests as state_module
from pdserve.shared.state.keys import ENDED


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


def test_a_push_adds_again_the_deadline_a_redis_restarted_empty_lost(redis_url):
    async def scenario():
        store = State.connect(redis_url)
        await store.requests.record("lost", "decoding", deadline_s=30)
        await store.r.delete(DEADLINES, ENDED)   # (what a restart without persistence leaves of them)
        await store.requests.progressed(["lost"], 40)
        score = await store.r.zscore(DEADLINES, "lost")
        seconds, _ = await store.r.time()
        await store.close()
        return score - seconds

    assert 38 < asyncio.run(scenario()) <= 41


def test_a_push_or_an_event_after_the_end_sets_no_deadline(redis_url):
    async def scenario():
        store = State.connect(redis_url)
        await store.requests.record("done", "decoding", deadline_s=30)
        await store.requests.record("done", "finished")
        await store.requests.progressed(["done"], 40)                 # the worker's heartbeat, late
        await store.requests.postpone("done", 30)                     # a supervisor's round, late
        await store.requests.record("done", "decoding", deadline_s=30)  # a phase's event, landing late
        score = await store.r.zscore(DEADLINES, "done")
        await store.close()
        return score

    assert asyncio.run(scenario()) is None
