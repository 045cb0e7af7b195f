"""One request's trip through the system, as the gateway sees it: subscribe to its tokens,
ask the router for a placement, then yield its token chunks in order, once each — across a
decode worker's death.

Failover: when no chunk has come for `check_s`, the relay asks the request's decode worker on
the bus whether it is there (its answer, or the server's "no responders"); only with no
verdict from the bus (no answer in time, or this gateway's connection not settled) does its
registry lease decide. If it is missing twice, `confirm_s` apart (a Redis restarted empty
shows every worker missing until its next heartbeat), it places the request again with the
tokens generated so far (`generated_token_ids`, a new `attempt`), placed like a new request:
a prefill worker computes prompt + those tokens (the prompt usually from its prefix cache)
and hands the KV to another decode worker, which continues. Chunks carry the index of their first token,
so the stream goes on with nothing repeated and nothing missing; greedy and seeded sampling
continue exactly (the sampler's draw depends on the position, not the worker).

Chunks lost on the bus (NATS restarted) show as a gap in the sequence that stays open for
`check_s`, or silence for `check_s` after this gateway's connection came back. Then the
relay first asks the decode worker to publish its chunks again from the first one missing
(`pd.decode.<id>.replay`, pdserve/services/decode/chunk_log.py): nothing is recomputed. Only if it
cannot (it no longer has them, does not answer, or `MAX_REPLAYS` did not close the gap) is
the old placement cancelled (in case it still runs) and the request continued elsewhere
from its last streamed token. And when the router's supervisor says the placement stalled (its
worker heartbeats but the request has not advanced past its phase's deadline: a hung step).

The request's events go to Redis as it goes: received (with this gateway as its owner),
failover, and how it ended — finished, failed or cancelled (pdserve/shared/lifecycle.py). A request
given up while it is being placed (no router answered in time, or its client left) is
cancelled on the workers the routers noted for it: an admit that came too late to be heard
leaves no reservation running for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import trace

from pdserve.services.gateway.errors import RETRY_AFTER_S, APIError
from pdserve.services.gateway.records import Records
from pdserve.services.gateway.reorder import Reorder
from pdserve.shared import macs, metrics, quarantine, subjects
from pdserve.shared.absence import Absence
from pdserve.shared.bus import Bus
from pdserve.shared.config import GatewaySettings
from pdserve.shared.holders import Holders
from pdserve.shared.messages import Cancel, Replay, ReplayReply, RouteReply, RouteRequest, Stalled, TokenChunk
from pdserve.shared.state import State, placement_key

log = logging.getLogger("gateway.relay")
MAX_ATTEMPTS = 4  # placements of one request: the first and up to three failovers
MAX_REPLAYS = 3   # replays asked of one placement before it is moved instead
REPLAY_TIMEOUT_S = 2.0  # a decode worker answers from its event loop; silence this long: move the stream
BUS_SETTLED_S = 5.0     # this gateway's bus connection up this long before a worker's absence from it counts


@dataclass(frozen=True)
class RelayTimings:
    """How long the relay waits for a router and for tokens, and how it judges a silent placement."""

    route_timeout_s: float                 # a router's answer to one placement request
    token_timeout_s: float                 # no token this long: the request fails (504)
    check_s: float = 1.0                   # silence this long: is the placement still there?
    confirm_s: float = 1.5                 # absent this long from the registry = lost
    placement_retry_s: float = 0.0         # keep asking while nothing can take the request
    probe: bool = False                    # also ask a silent decode worker on the bus

    @classmethod
    def for_gateway(cls, settings: GatewaySettings) -> RelayTimings:
        return cls(settings.route_timeout_s, settings.token_timeout_s, check_s=settings.failover_check_s,
                   confirm_s=settings.absent_s, placement_retry_s=settings.placement_retry_s, probe=True)


class Relay:
    def __init__(self, bus: Bus, timings: RelayTimings, records: Records | None = None):
        self.bus, self.timings = bus, timings
        self.records = records or Records()
        self.bus_seen = (self.reconnects(), time.monotonic())  # this gateway's reconnections, since when

    @classmethod
    def for_gateway(cls, settings: GatewaySettings, bus: Bus, state: State, owner: str) -> Relay:
        """The relay a gateway's settings describe: leases read from, and events noted in, `state`."""
        return cls(bus, RelayTimings.for_gateway(settings), Records.of(state, owner))

    @property
    def owner(self) -> str:
        return self.records.owner

    async def run(self, req: RouteRequest) -> tuple[RouteReply, AsyncIterator[TokenChunk]]:
        """Place the request; returns the placement and its ordered token stream. The
        subscriptions exist before anything can produce a token (or a supervisor's word), so
        none is missed."""
        queue: asyncio.Queue[TokenChunk | Stalled] = asyncio.Queue()
        req = req.model_copy(update={"secret": macs.new_secret()})
        secrets = {req.attempt: req.secret}  # each placement's (failover adds one): chunks are taken signed by one

        async def on_chunk(msg: Msg) -> None:
            chunk = macs.opened(req.request_id, secrets, msg.data, (msg.headers or {}).get(macs.HEADER, ""))
            if chunk is None:
                metrics.FORGED_CHUNKS.inc()   # (counted, not logged: a flood of them would flood the log)
                return
            queue.put_nowait(chunk)

        async def on_event(msg: Msg) -> None:
            queue.put_nowait(Stalled.decode(msg.data))

        self.records.note(req.request_id, "received", by=self.owner, owner=self.owner,
                          prompt_tokens=len(req.prompt_token_ids), max_tokens=req.sampling.max_tokens)
        subs = Subscriptions([await self.bus.subscribe(subjects.tokens(req.request_id), on_chunk),
                              await self.bus.subscribe(subjects.stalled(req.request_id), on_event)])
        try:
            reply = await self.place(req)
        except BaseException as e:  # refused for good, the client gone meanwhile, or a failure here
            await subs.unsubscribe()
            await asyncio.shield(self.abandon(req))
            outcome, reason = ("failed", e.message) if isinstance(e, APIError) else \
                ("cancelled", "client gone") if isinstance(e, asyncio.CancelledError) else ("failed", repr(e))
            self.records.note(req.request_id, outcome, by=self.owner, owner=self.owner, reason=reason)
            metrics.REQUESTS.labels(outcome).inc()
            raise
        return reply, self._ordered(req, reply, queue, subs, secrets)

    async def abandon(self, req: RouteRequest) -> None:
        """The request gives up its placement while a router may have admitted it meanwhile (its
        answer late or lost): cancel it on the workers the routers noted for the placement, so
        no reservation or prefill job runs on for nobody. (A cancel that reaches a decode
        worker before the admit it races finds nothing: that reservation runs to its end.)"""
        if self.records.placed is None:
            return
        try:
            known = await self.records.placed(placement_key(req.request_id, req.attempt))
        except Exception as e:  # noqa: BLE001 - Redis away: nothing known to cancel
            log.debug("%s: placement not read: %s", req.request_id, e)
            return
        holders = Holders()
        holders.add(known.get("decode"), secret=req.secret)
        if "reply" in known:
            reply = RouteReply.decode(known["reply"].encode())
            holders.add(reply.decode_worker, reply.prefill_worker, req.secret)
        await holders.cancel(self.bus, Cancel(request_id=req.request_id, reason="placement abandoned"))

    async def place(self, req: RouteRequest, retry_s: float | None = None) -> RouteReply:
        """Ask a router. While no router answers or none can place the request (no decode worker
        up or with room: a worker restarting, the registry refilling after a Redis restart),
        ask again for up to `placement_retry_s`, then 503. Placement is idempotent by request
        id and attempt, so asking again never places twice. Over the TTFT objective: 429 now."""
        deadline = time.monotonic() + (self.timings.placement_retry_s if retry_s is None else retry_s)
        pause = 0.25
        while True:
            try:
                reply = await self.bus.request(subjects.ROUTE, req, RouteReply, timeout=self.timings.route_timeout_s)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                reply = None
            if reply is not None and (reply.ok or reply.retry_after_s > 0):
                break
            if time.monotonic() + pause > deadline:
                if reply is None:
                    raise APIError(503, "No router answered; the service is starting or overloaded. Retry shortly.",
                                   code="router_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
                raise APIError(503, f"The request could not be placed: {reply.reason}.", code="no_capacity")
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)
        if not reply.ok:  # would wait longer than the objective: say when to come back
            raise APIError(429, f"The service is busy: {reply.reason}. Retry after "
                                f"{math.ceil(reply.retry_after_s)} s.", code="ttft_objective_exceeded",
                           headers={"Retry-After": str(math.ceil(reply.retry_after_s))})
        return reply

    async def _ordered(self, req: RouteRequest, placement: RouteReply, queue: asyncio.Queue,
                       sub: Subscriptions, secrets: dict[int, str] | None = None) -> AsyncIterator[TokenChunk]:
        """Chunks in `seq` order, once each (reorder.py), of the request's current placement
        only (a worker it left may still publish: dropped, counted). Silence, a gap that stays open, or the
        supervisor's word moves the request (`recover`). Its end goes to Redis and, unless it
        finished, a cancel to every worker it was placed on."""
        stream = Stream(placement, req.attempt, self.liveness(), secrets if secrets is not None else {})
        stream.holders.add(placement.decode_worker, placement.prefill_worker, stream.secrets.get(req.attempt, ""))
        outcome, reason = "cancelled", "client gone"
        try:
            while not stream.order.finished:
                try:
                    item = await asyncio.wait_for(queue.get(), self.timings.check_s)
                except TimeoutError:
                    item = None
                if isinstance(item, TokenChunk) and item.attempt != stream.attempt:  # a placement it left
                    metrics.STALE_CHUNKS.inc()
                    log.info("%s: chunk %d of attempt %d from %s dropped (attempt %d now)", req.request_id,
                             item.seq, item.attempt, item.worker or "?", stream.attempt)
                    continue
                await self.recover(req, stream, item)
                if isinstance(item, TokenChunk):
                    stream.liveness.silent_since = time.monotonic()
                    if item.error:
                        raise APIError(quarantine.STATUS, item.error, code=quarantine.CODE) if item.quarantined \
                            else APIError(503, f"The request failed: {item.error}", code="worker_error")
                    for chunk in stream.order.add(item):
                        yield chunk
        except APIError as e:
            outcome, reason = "failed", e.message
            raise
        finally:
            await sub.unsubscribe()
            if stream.order.finished:
                outcome, reason = "finished", ""
            else:  # client gone, timeout or error: stop the work wherever it was placed
                await stream.holders.cancel(self.bus, Cancel(request_id=req.request_id))
            self.records.note(req.request_id, outcome, by=self.owner, attempt=stream.attempt, owner=self.owner,
                              tokens=len(stream.order.generated), reason=reason)
            metrics.REQUESTS.labels(outcome).inc()

    async def recover(self, req: RouteRequest, stream: Stream, item: TokenChunk | Stalled | None) -> None:
        """One step of recovery, with each chunk or word (None: `check_s` of silence): chunks
        lost on the bus are asked of the decode worker again (up to MAX_REPLAYS); a lost or
        stalled worker, or chunks it cannot replay, move the request (cancelled where it was,
        placed again after its last streamed token)."""
        why = await self.interrupted(item, req.request_id, stream.placement, stream.attempt, stream.order.gap,
                                     stream.liveness)
        if why == "stream interrupted" and stream.replays < MAX_REPLAYS and await self.replay(
                req.request_id, stream.placement, stream.order.next_seq, stream.attempt):
            stream.replays += 1
            stream.liveness = self.liveness()
            return
        if why:
            # the old placement may still run (chunks lost on the bus, a lease that lapsed
            # for a moment, a hung step): stop it before the request goes elsewhere
            stream.attempt += 1
            stream.secrets[stream.attempt] = macs.new_secret()
            await stream.holders.cancel(self.bus, Cancel(request_id=req.request_id, reason="failover",
                                                         before_attempt=stream.attempt))
            stream.placement = await self.failover(req, stream.placement, stream.order.generated, stream.attempt,
                                                   why, stream.secrets[stream.attempt])
            stream.holders.add(stream.placement.decode_worker, stream.placement.prefill_worker,
                               stream.secrets[stream.attempt])
            stream.order.forget_waiting()
            stream.liveness, stream.replays = self.liveness(), 0

    async def interrupted(self, item: TokenChunk | Stalled | None, rid: str, placement: RouteReply, attempt: int,
                          gap: bool, liveness: Liveness) -> str:
        """Why the request must move now ("" when it need not): its worker lost, its chunks
        lost on the bus, or stalled (the supervisor's word about this placement). Called
        with each chunk or word, and with None after `check_s` of silence."""
        if isinstance(item, Stalled):
            return f"stalled in {item.phase}" if item.attempt == attempt else ""
        if item is not None:
            return ""
        if time.monotonic() - liveness.silent_since > self.timings.token_timeout_s:
            raise APIError(504, f"No token for {self.timings.token_timeout_s:.0f} s; the request was cancelled.",
                           code="timeout")
        if liveness.absence.gone("decode", not await self.absent(placement, rid), time.monotonic()):
            return "worker lost"
        if gap or self.reconnects() != liveness.reconnects:
            return "stream interrupted"
        return ""

    async def replay(self, rid: str, placement: RouteReply, from_seq: int, attempt: int) -> bool:
        """Ask the placement's decode worker to publish the chunks from `from_seq` again. No
        responders (its connection not back yet after the bus restarted) is asked again until
        REPLAY_TIMEOUT_S has passed."""
        if not placement.decode_worker:
            return False
        reply, until = None, time.monotonic() + REPLAY_TIMEOUT_S
        while reply is None and (left := until - time.monotonic()) > 0:
            try:
                reply = await self.bus.request(subjects.decode_replay(placement.decode_worker),
                                               Replay(request_id=rid, from_seq=from_seq), ReplayReply, timeout=left)
            except nats.errors.NoRespondersError:
                await asyncio.sleep(min(0.25, left))
            except nats.errors.TimeoutError:
                break
        if reply is not None and reply.ok:
            ok, chunks, why_not = True, reply.chunks, ""
        else:
            ok, chunks, why_not = False, 0, reply.reason if reply else "no answer"
        log.info("%s: chunks from %d lost on the bus; %s", rid, from_seq,
                 f"{placement.decode_worker} published {chunks} again" if ok
                 else f"{placement.decode_worker} cannot replay them ({why_not})")
        metrics.REPLAYS.labels("replayed" if ok else "refused").inc()
        self.records.note(rid, "replayed", by=self.owner, attempt=attempt, from_seq=from_seq, ok=ok,
                          decode=placement.decode_worker, reason=why_not)
        trace.get_current_span().add_event("replay", {"from_seq": from_seq, "ok": ok, "chunks": chunks})
        return ok

    def liveness(self) -> Liveness:
        """A placement's signs of life from now on."""
        return Liveness(time.monotonic(), self.reconnects(), Absence(self.timings.confirm_s))

    def reconnects(self) -> int:
        return getattr(self.bus, "reconnects", 0)

    async def absent(self, placement: RouteReply, rid: str) -> bool:
        """The request's decode worker has no connection to the bus (`on_bus`: a killed
        process's connection is closed by the server at once, seconds before its lease
        lapses). Only where the bus gives no verdict does the registry decide (its lease):
        a worker that answers on the bus is there, whatever a Redis restarted empty says.
        Redis unreachable too: no verdict."""
        worker = placement.decode_worker
        if not worker:
            return False
        on_bus = await self.on_bus(worker)
        if on_bus is not None:
            return not on_bus
        if self.records.alive is not None:
            try:
                return not await self.records.alive(worker)
            except Exception:  # noqa: BLE001
                pass
        return False

    async def on_bus(self, worker: str) -> bool | None:
        """Whether `worker` answers on the bus (a Ping on its replay subject): None — no
        verdict — unless `probe` and this gateway's own connection has been up for BUS_SETTLED_S
        without a reconnect (after a NATS restart the workers reconnect too, some later than
        this gateway), or when it does not answer in time."""
        count, since = self.bus_seen
        if self.reconnects() != count:
            self.bus_seen = count, since = self.reconnects(), time.monotonic()
        if not self.timings.probe or time.monotonic() - since < BUS_SETTLED_S:
            return None
        return await self.bus.heard(subjects.decode_replay(worker), self.timings.check_s)

    async def failover(self, req: RouteRequest, lost: RouteReply, generated: list[int], attempt: int,
                       why: str, secret: str = "") -> RouteReply:
        """Place the request again, to continue after `generated` (attempt > 0), under `secret`;
        unless it crashed its workers: a lost worker whose last pass held it charges it a crash,
        and at the second it fails (pdserve/shared/quarantine.py). Placed again, it carries the
        crashes charged so far (its next workers run its first passes alone)."""
        crashes = await self.records.charge(req.request_id, (lost.decode_worker or "") if why == "worker lost" else "")
        if quarantine.quarantined(crashes):
            log.error("%s: quarantined: %s", req.request_id, ", ".join(crashes))
            metrics.QUARANTINED.labels("decode").inc()
            raise APIError(quarantine.STATUS, quarantine.message(crashes), code=quarantine.CODE)
        trace.get_current_span().add_event("failover", {"why": why, "decode_worker": lost.decode_worker or "",
                                                        "resumed_after_tokens": len(generated), "attempt": attempt})
        metrics.FAILOVERS.labels(why.split(" in ")[0]).inc()   # worker lost, stream interrupted, stalled
        log.warning("%s: %s (%s); placing it again after %d tokens (attempt %d)", req.request_id, why,
                    lost.decode_worker, len(generated), attempt)
        self.records.note(req.request_id, "failover", by=self.owner, attempt=attempt, why=why,
                          lost=lost.decode_worker or "", resumed_after_tokens=len(generated))
        if attempt >= MAX_ATTEMPTS:
            raise APIError(503, f"The request's decode worker was lost {attempt} times; giving up.",
                           code="worker_lost")
        # the client is mid-stream: wait for a place as long as it would wait for a token
        # a stalled worker still heartbeats: the router tries the others first
        avoid = [lost.decode_worker] if why.startswith("stalled") and lost.decode_worker else []
        return await self.place(req.model_copy(update={"attempt": attempt, "generated_token_ids": list(generated),
                                                       "avoid_workers": avoid, "secret": secret,
                                                       "crashes": len(crashes)}),
                                retry_s=max(self.timings.placement_retry_s, self.timings.token_timeout_s))


@dataclass
class Liveness:
    """One placement's signs of life, as the relay has seen them."""

    silent_since: float                  # monotonic time of the last chunk (or of the placement)
    reconnects: int                      # the bus's reconnections when it began
    absence: Absence                     # its decode worker missing from the registry


@dataclass
class Stream:
    """A request being relayed: where it runs now, and what the relay has seen of it."""

    placement: RouteReply
    attempt: int
    liveness: Liveness
    secrets: dict[int, str]                                # each placement's, by attempt (pdserve/shared/macs.py)
    replays: int = 0                                       # asked of this placement so far
    order: Reorder = field(default_factory=Reorder)        # its chunks in order
    holders: Holders = field(default_factory=Holders)      # every placement's workers: a cancel goes to them alone


class Subscriptions:
    """A request's subscriptions (its tokens, its events), ended together."""

    def __init__(self, subs: list[Subscription]) -> None:
        self.subs = subs

    async def unsubscribe(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()
