"""Requeue (decode worker → router, `pd.router.requeue`): the prefill worker computing a
request's KV is gone or late. The prompt's prefill is placed again (placement.decide, bound to
the decode worker that admitted it: prefix index, queues, breakers as for a new request), among
the other prefill workers — or none fits (short prompt, breakers open, none left) and the decode
worker prefills it itself. Recorded as the request's `routed` again; the reply carries the
prefill's predicted time (the decode worker's KV deadline follows it). A request whose lost
worker's last pass held it is charged the crash first; at its second it is quarantined
(pdserve/shared/quarantine.py): the decode worker fails it. The reply carries the crashes charged so
far: the next prefill (here or on the decode worker) runs it alone."""

from __future__ import annotations

import logging
import time

from nats.aio.msg import Msg
from opentelemetry import trace

from pdserve.services.router import placement
from pdserve.services.router.bookings import Bookings
from pdserve.services.router.errors import EXPECTED
from pdserve.services.router.inputs import Inputs
from pdserve.services.router.placement import Refusal, Rules
from pdserve.shared import metrics, quarantine, tracing
from pdserve.shared.bus import Bus, context_of
from pdserve.shared.messages import Requeue, Requeued
from pdserve.shared.state import State

log = logging.getLogger("router")


class Requeues:
    def __init__(self, inputs: Inputs, bookings: Bookings, rules: Rules, bus: Bus, state: State,
                 tracer: trace.Tracer, router_id: str):
        self.inputs, self.bookings, self.rules, self.bus, self.state = inputs, bookings, rules, bus, state
        self.tracer, self.id = tracer, router_id

    async def on_requeue(self, msg: Msg) -> None:
        req = Requeue.decode(msg.data)
        with tracing.continued(self.tracer, "router.requeue", context_of(msg)) as span:
            span.set_attributes({"request_id": req.request_id, "decode_worker": req.decode_worker, "why": req.why,
                                 "avoid_workers": req.avoid_workers, "attempt": req.attempt, "router": self.id})
            try:
                reply = await self.requeue(req)
            except Exception as e:  # Redis trouble: the decode worker prefills it itself
                log.error("%s: requeue failed: %r", req.request_id, e, exc_info=not isinstance(e, EXPECTED))
                reply = Requeued(request_id=req.request_id, reason=f"requeue failed: {e}")
            span.set_attributes({"prefill_worker": reply.prefill_worker or "", "reason": reply.reason})
            await self.bus.respond(msg, reply)

    async def requeue(self, req: Requeue) -> Requeued:
        """Placed again with the crashes charged to it so far (its lost worker's included), or
        quarantined at the second; a late worker is charged none (only read)."""
        lost = req.avoid_workers[-1] if req.why == "gone" and req.avoid_workers else ""
        crashes = await self.state.crashes.charge(req.request_id, lost)
        if quarantine.quarantined(crashes):
            log.error("%s: quarantined: %s", req.request_id, ", ".join(crashes))
            metrics.QUARANTINED.labels("prefill").inc()
            return Requeued(request_id=req.request_id, quarantined=True, reason=quarantine.message(crashes),
                            crashes=len(crashes))
        return (await self.place(req)).model_copy(update={"crashes": len(crashes)})

    async def place(self, req: Requeue) -> Requeued:
        """Another prefill worker for the job, or none (the decode worker prefills it)."""
        gathered = await self.inputs.of_requeue(req)
        if gathered is None:
            return Requeued(request_id=req.request_id, reason=f"decode worker {req.decode_worker} not registered")
        ask, fleet = gathered
        chosen = placement.decide(ask, fleet, self.bookings.books(time.monotonic()), self.rules).first
        if isinstance(chosen, Refusal):  # (a plan bound to a decode worker always has it)
            return Requeued(request_id=req.request_id, reason=chosen.reason)
        metrics.PLACEMENTS.labels(chosen.mode, "requeued").inc()
        if chosen.prefill is None:
            return Requeued(request_id=req.request_id, reason=chosen.reason)
        self.bookings.sent_to(chosen, ask.tokens, time.monotonic())
        reason = f"requeued from {req.avoid_workers[-1]} ({req.why}): {chosen.reason}"
        self.state.requests.note(req.request_id, "routed", by=self.id, attempt=req.attempt, prompt_tokens=ask.tokens,
                                 mode="remote", reason=reason, decode=chosen.decode.worker_id,
                                 prefill=chosen.prefill.worker_id)
        return Requeued(request_id=req.request_id, prefill_worker=chosen.prefill.worker_id, reason=reason,
                        expected_prefill_s=chosen.expected_prefill_s)
