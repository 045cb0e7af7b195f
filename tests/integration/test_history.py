"""A request's own keys in Redis (pdserve/shared/state/requests.py): kept while it is in flight, kept
PD_HISTORY_S once it has ended (a late mark does not make them live longer), removed at its end when
that is 0. So Redis holds the requests in flight and a window of history, not every request ever."""

from __future__ import annotations

import asyncio

from pdserve.shared.state import GATEWAYS, REQUEST_TTL_S, State, log_key, request_key


async def ttls(store: State, rid: str) -> tuple[int, int]:
    return await store.r.ttl(request_key(rid)), await store.r.ttl(log_key(rid))


def test_a_finished_requests_keys_go_after_the_window_and_one_in_flight_keeps_its_own(redis_url):
    async def scenario():
        store = State.connect(redis_url, history_s=1)
        for phase in ("received", "routed", "decoding"):
            await store.requests.record("live", phase, by="decode-0")
            await store.requests.record("done", phase, by="decode-0")
        await store.requests.record("done", "finished", by="decode-0")
        await store.requests.record("late", "finished", by="decode-0")
        await store.requests.record("late", "replayed", by="gw-a")          # a mark after the end
        out = {"done": await ttls(store, "done"), "late": await ttls(store, "late"),
               "live": await ttls(store, "live")}
        await asyncio.sleep(1.5)
        out["after"] = {rid: await store.r.exists(request_key(rid), log_key(rid)) for rid in ("done", "late", "live")}
        await store.r.delete(request_key("live"), log_key("live"))
        await store.close()
        return out

    out = asyncio.run(scenario())
    assert out["done"] == (1, 1) and out["late"] == (1, 1), out
    assert all(REQUEST_TTL_S - 5 < t <= REQUEST_TTL_S for t in out["live"]), out
    assert out["after"] == {"done": 0, "late": 0, "live": 2}, out


def test_with_no_history_a_request_leaves_nothing_when_it_ends(redis_url):
    async def scenario():
        store = State.connect(redis_url, history_s=0)
        before = set(await store.r.keys("*"))
        for phase in ("received", "routed", "decoding", "cancelled"):
            await store.requests.record("gone", phase, by="gw-a", owner="gw-a")
        after = set(await store.r.keys("*"))
        await store.close()
        return {k.decode() for k in after - before}

    # its own keys, its deadline and its gateway's filing are gone; the fleet's list of gateways is control state
    assert asyncio.run(scenario()) <= {GATEWAYS}
