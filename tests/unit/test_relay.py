"""The gateway's ordering of token chunks: in seq order, duplicates dropped, cancel when left
early, and a lost decode worker's request continued elsewhere after the tokens so far."""

import asyncio

from pdserve.services.gateway.relay import Records, Relay, RelayTimings
from pdserve.shared.messages import Cancel, Ping, RouteReply, RouteRequest, Sampling, TokenChunk

REQ = RouteRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=Sampling(max_tokens=8), model="m")
PLACED = RouteReply(request_id="r", ok=True, mode="remote", decode_worker="d0", prefill_worker="p0")
FAILOVER = Cancel(request_id="r", reason="failover", before_attempt=1)   # stops placements before attempt 1


class FakeBus:
    def __init__(self):
        self.published = []

    async def publish(self, subject, msg, ctx=None, secret=""):
        self.published.append((subject, msg))

    async def heard(self, subject, timeout):  # as pdserve.shared.bus.Bus's, over this bus's request
        import nats.errors
        try:
            await self.request(subject, Ping(), None, timeout)
        except nats.errors.NoRespondersError:
            return False
        except Exception:  # noqa: BLE001
            return None
        return True


class FakeSub:
    unsubscribed = False

    async def unsubscribe(self):
        self.unsubscribed = True


def chunk(seq, n=1, finished=False, attempt=0, token=100):
    return TokenChunk(request_id="r", seq=seq, token_ids=[token + seq + i for i in range(n)], text=f"<{seq}>",
                      finished=finished, attempt=attempt)


def collect(chunks, stop_after=None):
    async def run():
        bus, sub, queue = FakeBus(), FakeSub(), asyncio.Queue()
        for c in chunks:
            queue.put_nowait(c)
        got = []
        gen = Relay(bus, RelayTimings(1, 0.2))._ordered(REQ, PLACED, queue, sub)
        async for c in gen:
            got.append(c.seq)
            if stop_after is not None and len(got) == stop_after:
                break
        await gen.aclose()
        return got, bus.published, sub.unsubscribed
    return asyncio.run(run())


def test_out_of_order_and_duplicate_chunks_come_out_once_in_order():
    got, published, unsubscribed = collect([chunk(1), chunk(0), chunk(0), chunk(2, n=2), chunk(1),
                                            chunk(4, finished=True)])
    assert got == [0, 1, 2, 4] and published == [] and unsubscribed


def test_leaving_early_cancels_the_request_on_its_workers():
    got, published, _ = collect([chunk(0), chunk(1), chunk(2, finished=True)], stop_after=1)
    assert got == [0]
    assert published == [("pd.decode.d0.cancel", Cancel(request_id="r")),
                         ("pd.prefill.p0.cancel", Cancel(request_id="r"))]


def _d0_lost_after_token_1(after_failover):
    """d0 streams tokens 0-1 and loses its lease; placed again, the relay is sent
    `after_failover`. Returns the chunks streamed and the route requests made."""
    async def run():
        queue, routed = asyncio.Queue(), []

        class Bus(FakeBus):
            async def request(self, subject, msg, reply_type, timeout):
                routed.append(msg)
                for c in after_failover:
                    queue.put_nowait(c)
                return RouteReply(request_id="r", ok=True, mode="local", decode_worker="d1")

        async def alive(worker):
            return worker != "d0"

        for c in (chunk(0), chunk(1)):
            queue.put_nowait(c)
        relay = Relay(Bus(), RelayTimings(1, 10, check_s=0.05), Records(alive=alive))
        return [c async for c in relay._ordered(REQ, PLACED, queue, FakeSub())], routed

    return asyncio.run(run())


def test_a_lost_decode_worker_is_replaced_and_the_stream_goes_on_without_gaps_or_repeats():
    """d0 streams tokens 0-1 and dies (its lease lapsed); the relay asks for a new placement
    with those tokens; d1 continues from token 2 (its replay of token 1 is dropped)."""
    got, routed = _d0_lost_after_token_1([chunk(1, attempt=1), chunk(2, attempt=1),
                                          chunk(3, finished=True, attempt=1)])   # from d1
    assert [c.seq for c in got] == [0, 1, 2, 3]
    assert len(routed) == 1 and routed[0].attempt == 1 and routed[0].generated_token_ids == [100, 101]
    assert routed[0].request_id == "r" and routed[0].prompt_token_ids == [1, 2, 3]


def test_chunks_of_a_placement_the_request_left_are_dropped_and_counted():
    """d0 is lost after token 1 but still publishes (a worker cut off from its lease, not
    dead): its token 2 arrives before d1's. The stream takes d1's (attempt 1) and counts d0's."""
    from pdserve.shared import metrics

    before = metrics.STALE_CHUNKS._value.get()
    got, _ = _d0_lost_after_token_1([chunk(2, token=900), chunk(2, attempt=1), chunk(3, finished=True, attempt=1)])
    assert [c.token_ids for c in got] == [[100], [101], [102], [103]]
    assert metrics.STALE_CHUNKS._value.get() == before + 1


def test_a_cancel_goes_to_the_workers_of_every_placement_once_each():
    """d0 (fed by p0) is lost and d1 continues; then the client leaves: the cancel goes to d0,
    p0 and d1 — a worker that missed the failover's cancel still hears this one — and to no
    other worker."""
    async def run():
        queue = asyncio.Queue()

        class Bus(FakeBus):
            async def request(self, subject, msg, reply_type, timeout):
                queue.put_nowait(chunk(1, attempt=1))   # from d1
                return RouteReply(request_id="r", ok=True, mode="local", decode_worker="d1")

        async def alive(worker):
            return worker != "d0"

        queue.put_nowait(chunk(0))
        bus = Bus()
        relay = Relay(bus, RelayTimings(1, 10, check_s=0.05), Records(alive=alive))
        gen = relay._ordered(REQ, PLACED, queue, FakeSub())
        got = []
        async for c in gen:
            got.append(c.seq)
            if c.seq == 1:
                break
        await gen.aclose()
        return got, bus.published

    got, published = asyncio.run(run())
    assert got == [0, 1]
    left = Cancel(request_id="r")
    assert published == [("pd.decode.d0.cancel", FAILOVER), ("pd.prefill.p0.cancel", FAILOVER),
                         ("pd.decode.d0.cancel", left), ("pd.decode.d1.cancel", left),
                         ("pd.prefill.p0.cancel", left)]


def test_the_supervisors_word_moves_a_stalled_placement_once_and_a_stale_word_is_ignored():
    """d0 heartbeats but its step hangs after token 1: the supervisor's Stalled (attempt 0)
    moves the request like a lost worker, the old placement is cancelled first; a second word
    about attempt 0 arriving after the move changes nothing. Its events say so."""
    from pdserve.shared.messages import Stalled

    async def run():
        queue, routed, notes = asyncio.Queue(), [], []

        class Bus(FakeBus):
            async def request(self, subject, msg, reply_type, timeout):
                routed.append(msg)
                for c in (Stalled(request_id="r", attempt=0, phase="decoding"), chunk(2, attempt=1),
                          chunk(3, finished=True, attempt=1)):
                    queue.put_nowait(c)
                return RouteReply(request_id="r", ok=True, mode="local", decode_worker="d1")

        async def alive(worker):
            return True   # a hung worker keeps its lease

        for c in (chunk(0), chunk(1), Stalled(request_id="r", attempt=0, phase="decoding", worker="d0")):
            queue.put_nowait(c)
        bus = Bus()
        relay = Relay(bus, RelayTimings(1, 10, check_s=5),
                      Records(alive=alive, note=lambda rid, ev, **kw: notes.append((ev, kw)), owner="gw"))
        got = [c.seq async for c in relay._ordered(REQ, PLACED, queue, FakeSub())]
        return got, routed, bus.published, notes

    got, routed, published, notes = asyncio.run(run())
    assert got == [0, 1, 2, 3]
    assert len(routed) == 1 and routed[0].attempt == 1 and routed[0].generated_token_ids == [100, 101]
    assert published == [("pd.decode.d0.cancel", FAILOVER), ("pd.prefill.p0.cancel", FAILOVER)]
    assert [e for e, _ in notes] == ["failover", "finished"]
    assert notes[0][1]["why"] == "stalled in decoding" and notes[1][1]["attempt"] == 1
    assert routed[0].avoid_workers == ["d0"]   # it still heartbeats: tried last


def _gap_stream(replay_answer, away=0):
    """d0 streams token 0, token 1 is lost on the bus, token 2 arrives: the gap stays open.
    `away`: replay requests that find no responder first (d0 not reconnected yet)."""
    import nats.errors

    from pdserve.shared.messages import ReplayReply

    async def run():
        queue, asked, notes = asyncio.Queue(), [], []

        class Bus(FakeBus):
            async def request(self, subject, msg, reply_type, timeout):
                asked.append((subject, msg))
                if subject.endswith(".replay"):
                    if len(asked) <= away:
                        raise nats.errors.NoRespondersError
                    if isinstance(msg, Ping):   # its bus answers; nothing is published
                        return None
                    if replay_answer:
                        for c in (chunk(1), chunk(2), chunk(3, finished=True)):   # d0 publishes them again
                            queue.put_nowait(c)
                    return ReplayReply(request_id="r", ok=replay_answer, chunks=3 if replay_answer else 0)
                for c in (chunk(1, attempt=1), chunk(2, attempt=1), chunk(3, finished=True, attempt=1)):  # d1
                    queue.put_nowait(c)
                return RouteReply(request_id="r", ok=True, mode="local", decode_worker="d1")

        async def alive(worker):
            return True

        for c in (chunk(0), chunk(2)):
            queue.put_nowait(c)
        bus = Bus()
        relay = Relay(bus, RelayTimings(1, 10, check_s=0.05),
                      Records(alive=alive, note=lambda rid, ev, **kw: notes.append((ev, kw))))
        got = [c.seq async for c in relay._ordered(REQ, PLACED, queue, FakeSub())]
        return got, asked, bus.published, notes
    return asyncio.run(run())


def test_chunks_lost_on_the_bus_are_asked_again_of_the_decode_worker_not_recomputed():
    got, asked, published, notes = _gap_stream(replay_answer=True)
    assert got == [0, 1, 2, 3]
    assert [s for s, _ in asked] == ["pd.decode.d0.replay"] and asked[0][1].from_seq == 1
    assert published == []                                  # nothing cancelled, nothing placed again
    assert [e for e, _ in notes] == ["replayed", "finished"] and notes[0][1]["ok"] is True


def test_a_decode_worker_not_reconnected_yet_is_asked_again_before_the_stream_is_moved():
    got, asked, published, notes = _gap_stream(replay_answer=True, away=2)
    assert got == [0, 1, 2, 3]
    assert [s for s, _ in asked] == ["pd.decode.d0.replay"] * 3 and published == []
    assert [e for e, _ in notes] == ["replayed", "finished"] and notes[0][1]["ok"] is True


def test_a_worker_that_no_longer_has_the_chunks_costs_a_failover_instead():
    got, asked, published, notes = _gap_stream(replay_answer=False)
    assert got == [0, 1, 2, 3]
    assert [s for s, _ in asked] == ["pd.decode.d0.replay", "pd.router.route"]
    assert asked[1][1].attempt == 1 and asked[1][1].generated_token_ids == [100]
    assert published == [("pd.decode.d0.cancel", FAILOVER), ("pd.prefill.p0.cancel", FAILOVER)]
    assert [e for e, _ in notes] == ["replayed", "failover", "finished"]


def test_a_placement_given_up_is_cancelled_where_a_router_admitted_it():
    """No router answer in time (503), or the client gone while its request was being placed:
    a router may have admitted it meanwhile — the relay cancels it on the workers the routers
    noted (the decode worker asked; the placement's workers once its reply is recorded)."""
    import nats.errors

    from pdserve.services.gateway.errors import APIError

    async def run(client_leaves: bool):
        notes = []

        class Bus(FakeBus):
            async def subscribe(self, subject, cb):
                return FakeSub()

            async def request(self, subject, msg, reply_type, timeout):
                if client_leaves:
                    await asyncio.sleep(10)
                raise nats.errors.TimeoutError

        async def placed(key):
            return {"decode": "d0", "reply": PLACED.encode().decode()}

        bus = Bus()
        relay = Relay(bus, RelayTimings(0.01, 10, placement_retry_s=0),
                      Records(note=lambda rid, ev, **kw: notes.append((ev, kw)), placed=placed, owner="gw"))
        task = asyncio.ensure_future(relay.run(REQ))
        if client_leaves:
            await asyncio.sleep(0.05)
            task.cancel()
        try:
            await task
        except (APIError, asyncio.CancelledError) as e:
            outcome = type(e).__name__
        return outcome, bus.published, [e for e, _ in notes]

    abandoned = Cancel(request_id="r", reason="placement abandoned")
    for leaves, outcome, last in ((False, "APIError", "failed"), (True, "CancelledError", "cancelled")):
        got, published, notes = asyncio.run(run(leaves))
        assert got == outcome and notes == ["received", last]
        assert published == [("pd.decode.d0.cancel", abandoned), ("pd.prefill.p0.cancel", abandoned)]


def _silent_d0(settled: bool):
    """d0 streams token 0, then nothing; it is gone from the bus ("no responders") while its
    lease still holds. Returns the seqs streamed and the routes asked (a failover's)."""
    import time

    import nats.errors

    from pdserve.shared.messages import ReplayReply

    async def run():
        queue, routed = asyncio.Queue(), []

        class Bus(FakeBus):
            async def request(self, subject, msg, reply_type, timeout):
                if subject == "pd.decode.d0.replay":
                    raise nats.errors.NoRespondersError
                if subject.endswith(".replay"):
                    return None if isinstance(msg, Ping) else ReplayReply(request_id="r", ok=True)
                routed.append(msg)
                for c in (chunk(1, attempt=1), chunk(2, attempt=1), chunk(3, finished=True, attempt=1)):   # from d1
                    queue.put_nowait(c)
                return RouteReply(request_id="r", ok=True, mode="local", decode_worker="d1")

        async def alive(worker):
            return True   # its lease has not lapsed yet

        async def d0_goes_on():   # (when not moved: d0 was only slow)
            await asyncio.sleep(0.5)
            for c in (chunk(1), chunk(2), chunk(3, finished=True)):
                queue.put_nowait(c)

        queue.put_nowait(chunk(0))
        relay = Relay(Bus(), RelayTimings(1, 10, check_s=0.05, confirm_s=0.1, probe=True), Records(alive=alive))
        if settled:   # this gateway's connection has been up a while
            relay.bus_seen = (0, time.monotonic() - 10)
        else:
            asyncio.ensure_future(d0_goes_on())
        got = [c.seq async for c in relay._ordered(REQ, PLACED, queue, FakeSub())]
        return got, routed

    return asyncio.run(run())


def test_a_decode_worker_gone_from_the_bus_is_lost_before_its_lease_lapses():
    got, routed = _silent_d0(settled=True)
    assert got == [0, 1, 2, 3] and len(routed) == 1 and routed[0].attempt == 1


def test_just_after_this_gateway_reconnected_a_worker_missing_from_the_bus_is_no_verdict():
    got, routed = _silent_d0(settled=False)
    assert got == [0, 1, 2, 3] and routed == []   # it was only late: never moved


def _d0_lost_with_crashes(crashes):
    """d0 streams tokens 0-1 and is lost; the crashes charged to the request then are `crashes`.
    Returns what the stream gave (its chunks' seqs, or the APIError it ended with) and the route
    requests made."""
    from pdserve.services.gateway.errors import APIError

    async def run():
        queue, routed = asyncio.Queue(), []

        class Bus(FakeBus):
            async def request(self, subject, msg, reply_type, timeout):
                routed.append(msg)
                queue.put_nowait(chunk(2, finished=True, attempt=1))
                return RouteReply(request_id="r", ok=True, mode="local", decode_worker="d1")

        async def alive(worker):
            return worker != "d0"

        async def charge(rid, worker):
            return crashes if worker == "d0" else []

        for c in (chunk(0), chunk(1)):
            queue.put_nowait(c)
        relay = Relay(Bus(), RelayTimings(1, 10, check_s=0.05, confirm_s=0.1), Records(alive=alive, crashes=charge))
        try:
            return [c.seq async for c in relay._ordered(REQ, PLACED, queue, FakeSub())], routed
        except APIError as e:
            return e, routed

    return asyncio.run(run())


def test_a_request_lost_with_its_second_crash_fails_with_a_422_and_is_not_placed_again():
    """pdserve/shared/quarantine.py: one crash charged, the request moves on; two, it ends with the
    error naming the workers."""
    got, routed = _d0_lost_with_crashes(["d0@a"])
    assert got == [0, 1, 2] and len(routed) == 1 and routed[0].crashes == 1   # its next passes run alone
    err, routed = _d0_lost_with_crashes(["d0@a", "p0@b"])
    assert (err.status, err.code) == (422, "request_quarantined") and "(d0, p0)" in err.message, err
    assert routed == []


def test_a_quarantined_chunk_from_the_decode_worker_ends_the_stream_with_a_422():
    """A router refused the request's requeue (its second crash): the decode worker's error chunk says so."""
    from pdserve.services.gateway.errors import APIError

    refused = TokenChunk(request_id="r", seq=0, token_ids=[], text="", finished=True, error="crashed 2 workers",
                         quarantined=True)

    async def run():
        queue = asyncio.Queue()
        queue.put_nowait(refused)
        try:
            return [c async for c in Relay(FakeBus(), RelayTimings(1, 10))._ordered(REQ, PLACED, queue, FakeSub())]
        except APIError as e:
            return e

    err = asyncio.run(run())
    assert (err.status, err.code, err.message) == (422, "request_quarantined", "crashed 2 workers")
