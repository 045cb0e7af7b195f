"""Two router replicas against real NATS (JetStream) and Redis: a request is placed once,
however many times and wherever it is asked; a replica that dies mid-decision is taken over
on the decode worker it had chosen. Decode workers are stand-ins that answer admits and
queue the prefill job, as pdserve/services/decode does."""

from __future__ import annotations

import asyncio
import time

import pytest
from opentelemetry import trace

from pdserve.services.router.main import Router
from pdserve.shared import streams, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.config import RouterSettings
from pdserve.shared.messages import AdmitReply, AdmitRequest, PrefillJob, RouteReply, RouteRequest, Sampling, WorkerInfo
from pdserve.shared.state import State, claim_key, route_key


@pytest.fixture(scope="module")
def redis_url(redis_or_cluster_url):
    """One redis-server, then a Redis Cluster (tests/integration/conftest.py)."""
    return redis_or_cluster_url


def _worker(wid: str, role: str, running: int = 0) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role=role, model="m", fingerprint="fp", block_size=16, total_blocks=100,
                      free_blocks=100, running=running, ucx_address="00")


def _request(rid: str) -> RouteRequest:
    return RouteRequest(request_id=rid, prompt_token_ids=list(range(40)), sampling=Sampling(max_tokens=4), model="m")


def _job(rid: str, decode: str) -> PrefillJob:
    req = _request(rid)
    return PrefillJob(request_id=rid, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                      decode_worker=decode, decode_address="00", decode_fingerprint="fp", first_block=0,
                      kv_tag=7 << 20)


async def _setup(nats_url: str, redis_url: str):
    """Two routers, decode-0 idle and decode-1 busy (the router prefers decode-0), one prefill
    worker; returns the routers, the admits each decode stand-in saw, and a job counter."""
    state = State.connect(redis_url)
    await state.r.flushdb()
    for w in (_worker("decode-0", "decode"), _worker("decode-1", "decode", running=6), _worker("prefill-0", "prefill")):
        await state.registry.heartbeat(w, 60)
    bus = await Bus.connect(nats_url, "test")
    await streams.ensure(bus.js)
    await bus.js.delete_stream(subjects.PREFILL_STREAM)  # its jobs and the ids it deduplicates (earlier runs')
    await streams.ensure(bus.js)
    admits: dict[str, list[str]] = {"decode-0": [], "decode-1": []}

    def stand_in(wid: str):
        async def on_admit(msg):
            req = AdmitRequest.decode(msg.data)
            admits[wid].append(req.request_id)
            await asyncio.sleep(0.1)  # a real admit takes a moment: repeats arrive meanwhile
            await bus.respond(msg, AdmitReply(request_id=req.request_id, ok=True, num_blocks=3, kv_tag=7 << 20))
            if req.mode == "remote":
                await bus.queue_prefill(req.prefill_worker, _job(req.request_id, wid))
        return on_admit

    for wid in admits:
        await bus.subscribe(subjects.decode_admit(wid), stand_in(wid))
    tracer = trace.get_tracer("test")
    routers = [Router(RouterSettings(nats_url=nats_url, redis_url=redis_url, router_id=f"router-{x}",
                                     admit_timeout_s=0.5), bus, State.connect(redis_url), tracer) for x in "ab"]

    async def jobs(rid: str) -> int:
        await asyncio.sleep(0.2)  # the job is queued after the admit's reply
        info = await bus.js.stream_info(subjects.PREFILL_STREAM)
        count = 0
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await bus.js.get_msg(subjects.PREFILL_STREAM, seq)
            except Exception:  # noqa: BLE001 - deleted
                continue
            count += PrefillJob.decode(msg.data).request_id == rid
        return count

    return routers, admits, jobs, state, bus


def test_a_request_asked_of_two_replicas_at_once_and_again_is_placed_once(nats_url, redis_url):
    async def run():
        (a, b), admits, jobs, state, bus = await _setup(nats_url, redis_url)
        req = _request("r1")
        first, second = await asyncio.gather(a.route(req), b.route(req))
        third = await b.route(req)
        n_jobs = await jobs("r1")
        await bus.close()
        return first, second, third, admits, n_jobs

    first, second, third, admits, n_jobs = asyncio.run(run())
    assert first.ok and first.decode_worker == "decode-0" and first.prefill_worker == "prefill-0"
    assert second == first and third == first
    assert admits == {"decode-0": ["r1"], "decode-1": []}
    assert n_jobs == 1


def test_a_replica_that_died_mid_decision_is_taken_over_on_the_worker_it_chose(nats_url, redis_url):
    """router-dead had claimed r2, chosen decode-1 (busy: a fresh choice would be decode-0),
    whose admit queued the prefill job, and died before replying. router-b waits for the claim
    to lapse, then asks decode-1 again; the repeated job is dropped by the stream."""
    async def run():
        (a, b), admits, jobs, state, bus = await _setup(nats_url, redis_url)
        req = _request("r2")
        assert (await state.placements.begin("r2", "router-dead", 0.5, "", 60))[0]     # claimed
        assert await state.placements.renew("r2", "router-dead", 0.5, "decode-1", 60)   # noted before its admit
        await bus.queue_prefill("prefill-0", _job("r2", "decode-1"))
        t0 = time.monotonic()
        reply = await b.route(req)
        waited = time.monotonic() - t0
        n_jobs = await jobs("r2")
        await bus.close()
        return reply, waited, admits, n_jobs

    reply, waited, admits, n_jobs = asyncio.run(run())
    assert reply.ok and reply.decode_worker == "decode-1"
    assert 0.3 < waited < 3
    assert admits == {"decode-0": [], "decode-1": ["r2"]}
    assert n_jobs == 1


def test_a_refused_request_is_decided_afresh_next_time(nats_url, redis_url):
    async def run():
        (a, b), admits, jobs, state, bus = await _setup(nats_url, redis_url)
        req = _request("r3").model_copy(update={"model": "other"})
        refused = await a.route(req)
        left = await state.r.exists(route_key("r3"), claim_key("r3"))
        again = await b.route(req.model_copy(update={"model": "m"}))
        await bus.close()
        return refused, left, again

    refused, left, again = asyncio.run(run())
    assert not refused.ok and "no decode worker" in refused.reason
    assert left == 0
    assert again.ok


def test_a_route_during_the_first_background_registry_read_sees_the_workers(nats_url, redis_url):
    """A serving router re-reads the registry in the background; until its first read has
    landed, a route reads it itself rather than finding no worker."""
    async def run():
        (a, _), admits, jobs, state, bus = await _setup(nats_url, redis_url)
        a.pools.refreshing = True  # Pools.keep started, its first read not done
        reply = await a.route(_request("r4"))
        await bus.close()
        return reply

    assert asyncio.run(run()).ok


def test_an_overloaded_router_refuses_at_once_and_the_gateway_may_ask_again(nats_url, redis_url):
    """At its bound of placements in flight a router answers a refusal without working on the
    request (no claim taken), so the gateway's next ask — maybe to another replica — decides it."""
    async def run():
        (a, _), admits, jobs, state, bus = await _setup(nats_url, redis_url)
        a.settings = a.settings.model_copy(update={"max_routes_in_flight": 1})
        await bus.subscribe("test.route", a.start_route)
        a.in_flight = 1
        busy = await bus.request("test.route", _request("r5"), RouteReply, timeout=5)
        claimed = await state.r.exists(claim_key("r5"))
        a.in_flight = 0
        placed = await bus.request("test.route", _request("r5"), RouteReply, timeout=5)
        await bus.close()
        return busy, claimed, placed

    busy, claimed, placed = asyncio.run(run())
    assert not busy.ok and "router busy" in busy.reason and busy.retry_after_s == 0 and claimed == 0
    assert placed.ok
