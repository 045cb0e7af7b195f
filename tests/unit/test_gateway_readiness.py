"""The gateway's readiness verdict (pdserve/services/gateway/readiness.py) as its /ready answers it
(pdserve/shared/probes.py): the pools and NATS, the store away, a verdict gone stale, a drain."""

from __future__ import annotations

import asyncio
import signal
import time

import uvicorn
from fastapi import FastAPI

from pdserve.services.gateway import main, readiness
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.probes import STALE_S, Probes


def workers(*roles: str) -> list[WorkerInfo]:
    return [WorkerInfo(worker_id=f"{r}-{i}", role=r) for i, r in enumerate(roles)]


def test_ready_with_a_router_and_the_pools_registered_and_nats_connected():
    assert readiness.verdict(workers("router", "prefill", "decode"), True, True) == \
        ([], {"router": 1, "prefill": 1, "decode": 1})
    assert readiness.verdict(workers("router", "decode", "decode"), True, True)[0] == ["prefill"]
    assert readiness.verdict(workers("router", "decode"), False, True)[0] == []   # colocated
    assert readiness.verdict(workers("router", "prefill", "decode"), True, False)[0] == ["nats"]
    assert readiness.verdict([], True, True)[0] == ["router", "prefill", "decode"]


class Registry:
    def __init__(self, error: Exception | None = None):
        self.error, self.reads = error, 0

    async def workers(self) -> list[WorkerInfo]:
        self.reads += 1
        if self.error:
            raise self.error
        return workers("router", "prefill", "decode")


class State:
    def __init__(self, registry: Registry):
        self.registry = registry


def test_ready_answers_the_last_verdict_and_a_stale_one_is_not_ready():
    probes, registry = Probes(serving=True), Registry()
    asyncio.run(readiness.judge(State(registry), True, lambda: True, probes))   # type: ignore[arg-type]
    for _ in range(100):
        status, body = probes.ready()
    assert status == 200 and body["workers"] == {"router": 1, "prefill": 1, "decode": 1} and registry.reads == 1
    probes.judged = time.monotonic() - STALE_S - 1   # its background stopped judging
    status, body = probes.ready()
    assert status == 503 and body["missing"] == ["verdict"]


def test_the_store_away_is_a_verdict_not_ready_with_why():
    probes = Probes(serving=True)
    asyncio.run(readiness.judge(State(Registry(ConnectionError("refused"))), True, lambda: True,  # type: ignore[arg-type]
                                probes))
    status, body = probes.ready()
    assert status == 503 and body["missing"] == ["state store"] and "refused" in body["reason"]


def test_a_service_without_a_verdict_of_its_own_answers_as_before():
    status, body = Probes(serving=True).ready()
    assert status == 200 and body == {"ready": True, "serving": True, "draining": False}


def test_sigterm_turns_the_gateways_ready_to_503_while_its_streams_finish(monkeypatch):
    monkeypatch.setattr(main, "PROBES", probes := Probes(serving=True))
    probes.judge([])
    server = main.Draining(uvicorn.Config(FastAPI()))
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and probes.ready()[0] == 503 and probes.ready()[1]["draining"]
