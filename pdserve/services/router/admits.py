"""Asking a plan's decode workers in turn (placement.Plan: best first) until one admits the
request with the prefill planned for it: each admit books the prefill (routes decided meanwhile
see it), renews the router's claim noting the worker asked (a takeover asks it first), and asks
it (`pd.decode.admit.<worker>`: it reserves KV blocks and, when remote, queues the prefill job);
a refusal or no answer takes the booking back and the next is asked. The plan's closing Refusal
is the answer when none admits."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import nats.errors
from opentelemetry import trace

from pdserve.services.router.bookings import Bookings
from pdserve.services.router.placement import Placement, Plan, Refusal
from pdserve.shared import metrics, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.config import RouterSettings
from pdserve.shared.messages import AdmitReply, AdmitRequest, RouteReply, RouteRequest, WorkerInfo
from pdserve.shared.state import State

log = logging.getLogger("router")
ROUTE_TTL_S = 600.0  # a placement is answered again for this long (a retried or repeated request)


@dataclass
class Waits:
    """A placement's time in others' hands (span attributes: the router's own time is the rest)."""

    noted: str | None = None  # the decode worker noted with the claim (`placements.begin`): its admit needs no hold
    renew_s: float = 0.0   # renewing the claim in Redis
    admit_s: float = 0.0  # the decode workers answering admits
    admitted_at: float = 0.0  # wall time the admit that was taken went out: the `routed` event's time (the
    #                           decode worker queues the prefill at once: its `prefilling` may be noted first)


class Admits:
    def __init__(self, bus: Bus, state: State, bookings: Bookings, settings: RouterSettings, router_id: str,
                 background: Callable[[Coroutine], None]):
        self.bus, self.state, self.bookings, self.settings, self.id = bus, state, bookings, settings, router_id
        self.background = background

    async def ask(self, req: RouteRequest, key: str, lease_s: float, plan: Plan[WorkerInfo], waits: Waits
                  ) -> RouteReply:
        for chosen in plan:
            if isinstance(chosen, Refusal):
                metrics.PLACEMENTS.labels("refused", chosen.kind).inc()
                return RouteReply(request_id=req.request_id, ok=False, reason=chosen.reason,
                                  retry_after_s=chosen.retry_after_s)
            if await self.try_admit(req, key, lease_s, chosen, plan.ask.tokens, waits):
                return self.commit(req, chosen, plan, waits)
        raise AssertionError("a plan ends with a refusal")

    async def try_admit(self, req: RouteRequest, key: str, lease_s: float, chosen: Placement[WorkerInfo],
                        tokens: int, waits: Waits) -> bool:
        booked = self.bookings.tried(chosen, tokens, time.monotonic())
        asked = time.perf_counter()  # renew the claim (each admit may take its timeout) and note the worker asked
        if chosen.decode.worker_id != waits.noted:  # (noted with the claim: just now)
            await self.state.placements.renew(key, self.id, lease_s, chosen.decode.worker_id, ROUTE_TTL_S)
        waits.noted = None
        waits.renew_s += time.perf_counter() - asked
        asked, sent_at = time.perf_counter(), time.time()
        admit = await self.admit(chosen, req)
        waits.admit_s += time.perf_counter() - asked
        if admit is not None and admit.ok:
            waits.admitted_at = sent_at
            return True
        self.bookings.cancel(booked)
        return False

    def commit(self, req: RouteRequest, chosen: Placement[WorkerInfo], plan: Plan[WorkerInfo], waits: Waits
               ) -> RouteReply:
        """The decode worker admitted the request (and queued its prefill job when remote)."""
        decode, prefill = chosen.decode, chosen.prefill
        self.bookings.admitted.add(decode.worker_id, 1, time.monotonic())
        span = trace.get_current_span()
        if prefill is not None:
            span.set_attributes({"prefill_cached_tokens": prefill.cached_tokens,
                                 "prefill_queued_tokens": prefill.queued_tokens})
        span.set_attributes({"decode_cached_tokens": plan.fleet.cached_tokens(decode.worker_id),
                             "session_worker": plan.ask.session_worker or "",
                             "admit_wait_ms": 1e3 * waits.admit_s, "renew_ms": 1e3 * waits.renew_s})
        if req.session_id:
            self.background(self.state.sessions.set_worker(req.session_id, decode.worker_id,
                                                           self.settings.session_ttl_s))
        metrics.PLACEMENTS.labels(chosen.mode, chosen.kind).inc()
        return RouteReply(request_id=req.request_id, ok=True, mode=chosen.mode, reason=chosen.reason,
                          decode_worker=decode.worker_id,
                          prefill_worker=prefill.worker_id if prefill is not None else None)

    async def admit(self, chosen: Placement[WorkerInfo], req: RouteRequest) -> AdmitReply | None:
        msg = AdmitRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                           mode=chosen.mode, prefill_worker=chosen.prefill.worker_id if chosen.prefill else None,
                           generated_token_ids=req.generated_token_ids, attempt=req.attempt,
                           expected_prefill_s=chosen.expected_prefill_s, secret=req.secret, crashes=req.crashes)
        try:
            return await self.bus.request(subjects.decode_admit(chosen.decode.worker_id), msg, AdmitReply,
                                          timeout=self.settings.admit_timeout_s)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            log.warning("%s: decode worker %s did not answer the admit", req.request_id, chosen.decode.worker_id)
            return None
