"""The routers' supervisor against real NATS and Redis: a request that stops advancing while
its workers heartbeat is reported to its gateway once per period; the requests of a gateway
whose lease is gone are cancelled on their workers and recorded failed; moving and finished
requests are left alone."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.services.router.supervisor import Supervisor
from pdserve.shared.bus import Bus
from pdserve.shared.messages import Cancel, Stalled, WorkerInfo
from pdserve.shared.state import DEADLINES, GATEWAYS, State, owned_key


@pytest.fixture(scope="module")
def redis_url(redis_or_cluster_url):
    """One redis-server, then a Redis Cluster (tests/integration/conftest.py)."""
    return redis_or_cluster_url


async def _request(state: State, rid: str, gateway: str, deadline_s: float, prefill: str = "") -> None:
    await state.requests.record(rid, "received", by=gateway, owner=gateway)
    await state.requests.record(rid, "routed", by="router", decode="decode-0", prefill=prefill, deadline_s=deadline_s)
    await state.requests.record(rid, "decoding", by="decode-0", deadline_s=deadline_s)


def test_stalled_requests_are_reported_and_orphans_cancelled(nats_url, redis_url):
    async def run():
        state = State.connect(redis_url)
        await state.r.flushdb()
        bus = await Bus.connect(nats_url, "test")
        heard: list = []

        async def on_cancel(msg):
            heard.append((msg.subject, Cancel.decode(msg.data)))

        async def on_event(msg):
            heard.append(Stalled.decode(msg.data))

        await bus.subscribe("pd.*.*.cancel.supervisor", on_cancel)   # any worker's (the routers' subjects)
        await bus.subscribe("pd.stalled.*", on_event)
        for w in (WorkerInfo(worker_id="gw-a", role="gateway"), WorkerInfo(worker_id="decode-0", role="decode")):
            await state.registry.heartbeat(w, 60)
        await _request(state, "stuck", "gw-a", 0.1)      # its worker lives, no token comes
        await _request(state, "moving", "gw-a", 0.1)     # tokens keep coming (the decode worker pushes it on)
        await _request(state, "orphan", "gw-b", 30, prefill="prefill-0")   # its gateway has no lease
        await _request(state, "done", "gw-a", 0.1)
        await _request(state, "unheeded", "gw-a", 0.1)   # reported once already; its gateway did nothing
        await state.requests.record("unheeded", "stalled", by="router", in_phase="decoding")
        await state.requests.record("done", "finished", by="gw-a", owner="gw-a")
        await asyncio.sleep(0.2)
        await state.requests.progressed(["moving", "done"], 30)   # "done" ended: not put back
        sup = Supervisor(bus, state, "router-t", stall_s=5.0, confirm_s=0.3)
        for _ in range(8):   # gw-b: seen gone, confirmed 0.3 s later, its requests taken, then its empty set
            await sup.round()
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)
        await bus.nc.flush()
        stuck_status = (await state.requests.summary("stuck"))["phase"]
        orphan = await state.requests.events("orphan")
        left = {m.decode() for m in await state.r.zrange(DEADLINES, 0, -1)}
        owned_b = await state.r.exists(owned_key("gw-b"))
        gateways = {g.decode() for g in await state.r.smembers(GATEWAYS)}
        unheeded = await state.requests.events("unheeded")
        await bus.close()
        await state.close()
        return heard, stuck_status, orphan, left, owned_b, gateways, unheeded

    heard, stuck_status, orphan, left, owned_b, gateways, unheeded = asyncio.run(run())
    stalled = [m for m in heard if isinstance(m, Stalled)]
    cancels = [m for m in heard if isinstance(m, tuple)]
    assert stalled == [Stalled(request_id="stuck", attempt=0, phase="decoding", worker="decode-0")]  # once a period
    assert sorted(cancels, key=lambda c: c[1].request_id) == [   # to the request's workers alone
        ("pd.decode.decode-0.cancel.supervisor", Cancel(request_id="orphan", reason="gateway lost")),
        ("pd.prefill.prefill-0.cancel.supervisor", Cancel(request_id="orphan", reason="gateway lost")),
        ("pd.decode.decode-0.cancel.supervisor",
         Cancel(request_id="unheeded", reason="stalled in decoding, not moved"))]
    assert unheeded[-1].event == "failed" and gateways == {"gw-a"}   # gw-b left the list once emptied
    assert stuck_status == "stalled"
    assert orphan[-1].event == "failed" and orphan[-1].fields["reason"] == "gateway gw-b lost"
    assert left == {"stuck", "moving"} and not owned_b   # stuck: due again after stall_s; orphan and done gone
