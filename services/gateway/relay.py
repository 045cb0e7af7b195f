"""One request's trip through the system, as the gateway sees it: subscribe to its tokens,
ask the router for a placement, then yield its token chunks in order, once each — across a
decode worker's death.

Failover: when no chunk has come for `check_s`, the relay asks the registry whether the
request's decode worker still holds its lease. If it is missing twice, `confirm_s` apart (a
Redis restarted empty shows every worker missing until its next heartbeat), it places the request again with the
tokens generated so far (`resume_token_ids`, a new `attempt`): another decode worker
prefills prompt + those tokens and continues. Chunks carry the index of their first token,
so the stream goes on with nothing repeated and nothing missing; greedy and seeded sampling
continue exactly (the sampler's draw depends on the position, not the worker).

The same when chunks were lost on the bus (NATS restarted): a gap in the sequence that stays
open for `check_s`, or silence for `check_s` after this gateway's connection came back. Then
the old placement is cancelled first (in case it still runs) and the request continues from
its last streamed token.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import nats.errors
from opentelemetry import trace

from shared import subjects
from shared.bus import Bus
from shared.messages import Cancel, RouteReply, RouteRequest, TokenChunk
from services.gateway.errors import APIError

MAX_ATTEMPTS = 4  # placements of one request: the first and up to three failovers


class Relay:
    def __init__(self, bus: Bus, route_timeout_s: float, token_timeout_s: float,
                 alive: Callable[[str], Awaitable[bool]] | None = None, check_s: float = 1.0,
                 confirm_s: float = 1.5, placement_retry_s: float = 0.0):
        self.bus, self.route_timeout_s, self.token_timeout_s = bus, route_timeout_s, token_timeout_s
        self.alive, self.check_s = alive, check_s
        self.confirm_s = confirm_s                    # absent this long from the registry = lost
        self.placement_retry_s = placement_retry_s    # keep asking while nothing can take the request

    async def run(self, req: RouteRequest) -> tuple[RouteReply, AsyncIterator[TokenChunk]]:
        """Place the request; returns the placement and its ordered token stream. The
        subscription exists before anything can produce a token, so none is missed."""
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()

        async def on_chunk(msg) -> None:
            queue.put_nowait(TokenChunk.decode(msg.data))

        sub = await self.bus.subscribe(subjects.tokens(req.request_id), on_chunk)
        try:
            reply = await self.place(req)
        except APIError:
            await sub.unsubscribe()
            raise
        return reply, self._ordered(req, reply, queue, sub)

    async def place(self, req: RouteRequest, retry_s: float | None = None) -> RouteReply:
        """Ask a router. While no router answers or none can place the request (no decode worker
        up or with room: a worker restarting, the registry refilling after a Redis restart),
        ask again for up to `placement_retry_s`, then 503. Placement is idempotent by request
        id and attempt, so asking again never places twice. Over the TTFT objective: 429 now."""
        deadline = time.monotonic() + (self.placement_retry_s if retry_s is None else retry_s)
        pause = 0.25
        while True:
            try:
                reply = await self.bus.request(subjects.ROUTE, req, RouteReply, timeout=self.route_timeout_s)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                reply = None
            if reply is not None and (reply.ok or reply.retry_after_s > 0):
                break
            if time.monotonic() + pause > deadline:
                if reply is None:
                    raise APIError(503, "No router answered; the service is starting or overloaded. Retry shortly.",
                                   code="router_unavailable")
                raise APIError(503, f"The request could not be placed: {reply.reason}.", code="no_capacity")
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)
        if not reply.ok:  # would wait longer than the objective: say when to come back
            raise APIError(429, f"The service is busy: {reply.reason}. Retry after "
                                f"{math.ceil(reply.retry_after_s)} s.", code="ttft_objective_exceeded",
                           headers={"Retry-After": str(math.ceil(reply.retry_after_s))})
        return reply

    async def _ordered(self, req: RouteRequest, placement: RouteReply, queue: asyncio.Queue,
                       sub) -> AsyncIterator[TokenChunk]:
        """Chunks in `seq` order; duplicates (a retried step, a failover) are dropped."""
        next_seq, pending, done, generated, attempt = 0, {}, False, [], req.attempt
        silent_since, reconnects, absent_since = time.monotonic(), self.reconnects(), None
        try:
            while not done:
                try:
                    chunk = await asyncio.wait_for(queue.get(), self.check_s)
                except asyncio.TimeoutError:
                    if time.monotonic() - silent_since > self.token_timeout_s:
                        raise APIError(504, f"No token for {self.token_timeout_s:.0f} s; the request was cancelled.",
                                       code="timeout") from None
                    if await self.absent(placement):  # twice, confirm_s apart: a Redis restart empties
                        absent_since = absent_since or time.monotonic()  # the registry for a heartbeat
                    else:
                        absent_since = None
                    lost_worker = absent_since is not None and time.monotonic() - absent_since >= self.confirm_s
                    if lost_worker or pending or self.reconnects() != reconnects:
                        # the old placement may still run (chunks lost on the bus, or a lease that
                        # lapsed for a moment): stop it before the request goes elsewhere
                        attempt += 1
                        await self.bus.publish(subjects.cancel(req.request_id), Cancel(
                            request_id=req.request_id, reason="failover", before_attempt=attempt))
                        reconnects = self.reconnects()
                        placement = await self.failover(req, placement, generated, attempt,
                                                        "worker lost" if lost_worker else "stream interrupted")
                        pending.clear()
                        silent_since, absent_since = time.monotonic(), None
                    continue
                silent_since = time.monotonic()
                if chunk.error:
                    raise APIError(503, f"The request failed: {chunk.error}", code="worker_error")
                if chunk.seq >= next_seq:
                    pending[chunk.seq] = chunk
                while next_seq in pending:
                    chunk = pending.pop(next_seq)
                    next_seq += max(1, len(chunk.token_ids))
                    generated += chunk.token_ids
                    yield chunk
                    if chunk.finished:
                        done = True
                        break
        finally:
            await sub.unsubscribe()
            if not done:  # client gone, timeout or error: stop the work everywhere
                await self.bus.publish(subjects.cancel(req.request_id), Cancel(request_id=req.request_id))

    def reconnects(self) -> int:
        return getattr(self.bus, "reconnects", 0)

    async def absent(self, placement: RouteReply) -> bool:
        """The request's decode worker is missing from the registry (Redis unreachable: no verdict)."""
        if self.alive is None or not placement.decode_worker:
            return False
        try:
            return not await self.alive(placement.decode_worker)
        except Exception:  # noqa: BLE001
            return False

    async def failover(self, req: RouteRequest, lost: RouteReply, generated: list[int], attempt: int,
                       why: str) -> RouteReply:
        """Place the request again, to continue after `generated` (attempt > 0)."""
        trace.get_current_span().add_event("failover", {"why": why, "decode_worker": lost.decode_worker or "",
                                                        "resumed_after_tokens": len(generated), "attempt": attempt})
        if attempt >= MAX_ATTEMPTS:
            raise APIError(503, f"The request's decode worker was lost {attempt} times; giving up.",
                           code="worker_lost")
        # the client is mid-stream: wait for a place as long as it would wait for a token
        return await self.place(req.model_copy(update={"attempt": attempt, "resume_token_ids": list(generated)}),
                                retry_s=max(self.placement_retry_s, self.token_timeout_s))
