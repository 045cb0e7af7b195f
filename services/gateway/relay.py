"""One request's trip through the system, as the gateway sees it: subscribe to its tokens,
ask the router for a placement, then yield its token chunks in order, once each."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import nats.errors

from shared import subjects
from shared.bus import Bus
from shared.messages import Cancel, RouteReply, RouteRequest, TokenChunk
from services.gateway.errors import APIError


class Relay:
    def __init__(self, bus: Bus, route_timeout_s: float, token_timeout_s: float):
        self.bus, self.route_timeout_s, self.token_timeout_s = bus, route_timeout_s, token_timeout_s

    async def run(self, req: RouteRequest) -> tuple[RouteReply, AsyncIterator[TokenChunk]]:
        """Place the request; returns the placement and its ordered token stream. The
        subscription exists before anything can produce a token, so none is missed."""
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()

        async def on_chunk(msg) -> None:
            queue.put_nowait(TokenChunk.decode(msg.data))

        sub = await self.bus.subscribe(subjects.tokens(req.request_id), on_chunk)
        try:
            reply = await self.bus.request(subjects.ROUTE, req, RouteReply, timeout=self.route_timeout_s)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            await sub.unsubscribe()
            raise APIError(503, "No router answered; the service is starting or overloaded. Retry shortly.",
                           code="router_unavailable")
        if not reply.ok:
            await sub.unsubscribe()
            if reply.retry_after_s > 0:  # would wait longer than the objective: say when to come back
                raise APIError(429, f"The service is busy: {reply.reason}. Retry after "
                                    f"{math.ceil(reply.retry_after_s)} s.", code="ttft_objective_exceeded",
                               headers={"Retry-After": str(math.ceil(reply.retry_after_s))})
            raise APIError(503, f"The request could not be placed: {reply.reason}.", code="no_capacity")
        return reply, self._ordered(req.request_id, queue, sub)

    async def _ordered(self, request_id: str, queue: asyncio.Queue, sub) -> AsyncIterator[TokenChunk]:
        """Chunks in `seq` order; duplicates (a retried step, a failover) are dropped."""
        next_seq, pending, done = 0, {}, False
        try:
            while not done:
                try:
                    chunk = await asyncio.wait_for(queue.get(), self.token_timeout_s)
                except asyncio.TimeoutError:
                    raise APIError(504, f"No token for {self.token_timeout_s:.0f} s; the request was cancelled.",
                                   code="timeout") from None
                if chunk.error:
                    raise APIError(503, f"The request failed: {chunk.error}", code="worker_error")
                if chunk.seq >= next_seq:
                    pending[chunk.seq] = chunk
                while next_seq in pending:
                    chunk = pending.pop(next_seq)
                    next_seq += max(1, len(chunk.token_ids))
                    yield chunk
                    if chunk.finished:
                        done = True
                        break
        finally:
            await sub.unsubscribe()
            if not done:  # client gone, timeout or error: stop the work everywhere
                await self.bus.publish(subjects.cancel(request_id), Cancel(request_id=request_id))
