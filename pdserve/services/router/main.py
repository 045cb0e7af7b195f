"""Router: where each request runs, admitted on a decode worker that is told its prefill worker.
A thin shell around one pure decision (placement.decide): it gathers, asks, claims and sends.

1. Start: make sure the prefill work queue exists; join the `router` queue group on
   `pd.router.route` (several replicas share the requests) and `pd.router.requeue`.
2. Route (gateway → here, a task each: an admit that waits on a dying worker delays only its
   own): the inputs (inputs.py: the live workers as last read from the registry, re-read in the
   background every 0.2 s; the workers holding the prompt's leading blocks, indexes.py; the
   conversation's worker), then the decision (placement.decide: the decode workers in order,
   each with its prefill planned, or a refusal, the TTFT objective's included).
3. Claim: one Redis round trip claims the request and notes the first decode worker chosen,
   before it is asked (`placements.begin`). Placement is idempotent by request id across
   replicas: a repeat gets the reply stored, or waits while another replica decides; if that
   replica dies mid-decision its claim lapses and this one takes over, asking the noted decode
   worker first (an admit is idempotent there, and the prefill job deduplicated by its id).
4. Admit (admits.py): the plan's decode workers in turn until one admits (it reserves KV blocks
   and, when remote, queues the prefill job on JetStream): no prefill for a request with nowhere
   to decode. The reply is stored (not awaited) with the request's `routed` event.
5. Reply to the gateway with the placement and its reason (also on the `router.route` span).
6. Beside: breakers (breakers.py: every replica hears how each KV handoff ended, `pd.kv.outcomes`);
   requeues (requeue.py: a prompt's prefill placed again when its prefill worker is gone or late);
   the supervisor (supervisor.py: requests past their phase's deadline are moved, those whose
   gateway is gone cancelled); the dead letters (dead_letters.py: prefill jobs delivered too
   often). SIGTERM: leave the queue groups, finish the routes, drain NATS.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from dataclasses import replace

from nats.aio.msg import Msg
from opentelemetry import trace

from pdserve.services.router import placement
from pdserve.services.router.admits import ROUTE_TTL_S, Admits, Waits
from pdserve.services.router.bookings import Bookings
from pdserve.services.router.breakers import Breakers
from pdserve.services.router.dead_letters import DeadLetters
from pdserve.services.router.errors import EXPECTED
from pdserve.services.router.indexes import open_index
from pdserve.services.router.inputs import Inputs
from pdserve.services.router.placement import Rules
from pdserve.services.router.pools import Pools
from pdserve.services.router.registry import Bounds
from pdserve.services.router.requeue import Requeues
from pdserve.services.router.supervisor import Supervisor
from pdserve.shared import identity, metrics, metrics_vllm, subjects, tracing
from pdserve.shared.bus import Bus, context_of
from pdserve.shared.config import RouterSettings
from pdserve.shared.messages import KVOutcome, RouteReply, RouteRequest, WorkerInfo
from pdserve.shared.service import connect, heartbeat, run, serving, setup_logging, stop_event
from pdserve.shared.state import State, placement_key
from pdserve.shared.tasks import Background

log = logging.getLogger("router")
GONE_LEASES = 10  # events: a worker's entries are dropped once it has been out of the registry this many leases


class Router:
    def __init__(self, settings: RouterSettings, bus: Bus, state: State, tracer: trace.Tracer):
        self.settings, self.bus, self.state, self.tracer = settings, bus, state, tracer
        self.id = identity.instance_id("router", settings.enroll_token, settings.router_id,
                                       f"router-{uuid.uuid4().hex[:8]}")
        self.pools = Pools(state, settings.stall_s,
                           Bounds(settings.max_worker_blocks, settings.max_prefill_tokens_per_s))
        self.index = open_index(settings.prefix_index, bus, state, self.id, self.pools.registered,
                                GONE_LEASES * settings.lease_s, settings.supervise_s)
        self.inputs = Inputs(self.pools, self.index)
        self.rules = Rules.of(settings)
        self.breakers = Breakers(settings.breaker_failures, settings.breaker_window_s, settings.breaker_cooldown_s)
        self.bookings = Bookings(settings.heartbeat_s, self.breakers)
        self._background = Background(log, "background step")  # Redis or NATS away: logged, not fatal
        self.admits = Admits(bus, state, self.bookings, settings, self.id, self.in_background)
        self.requeues = Requeues(self.inputs, self.bookings, self.rules, bus, state, tracer, self.id)
        self.in_flight = 0       # placements being worked on

    def in_background(self, coro: Coroutine) -> None:
        self._background.start(coro)

    async def serve(self, stop: asyncio.Event) -> None:
        await self.bus.wait_stream(subjects.PREFILL_STREAM)
        sub = await self.bus.subscribe(subjects.ROUTE, self.start_route, queue=subjects.ROUTER_QUEUE)
        requeues = await self.bus.subscribe(subjects.REQUEUE, self.start_requeue, queue=subjects.ROUTER_QUEUE)
        await self.bus.subscribe(subjects.KV_OUTCOMES, self.on_kv_outcome)  # every replica: all outcomes
        await DeadLetters(self.bus, self.state, self.id).start()
        me = WorkerInfo(worker_id=self.id, role="router")
        beat = asyncio.create_task(heartbeat(self.state, lambda: me, self.settings.heartbeat_s, stop))
        supervisor = Supervisor(self.bus, self.state, self.id, self.settings.stall_s, self.settings.lease_s,
                                registered=self.pools.registered)
        supervising = asyncio.create_task(supervisor.run(stop, self.settings.supervise_s))
        registry = asyncio.create_task(self.pools.keep(stop))
        await self.index.start(stop, self._background)
        log.info("router ready")
        serving()
        await stop.wait()
        await asyncio.gather(beat, supervising, registry)
        await self.state.registry.deregister(me.worker_id)
        await sub.drain()
        await requeues.drain()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.index.close()

    async def start_requeue(self, msg: Msg) -> None:
        self.in_background(self.requeues.on_requeue(msg))

    async def on_kv_outcome(self, msg: Msg) -> None:
        self.breakers.record(KVOutcome.decode(msg.data), time.monotonic())

    async def start_route(self, msg: Msg) -> None:
        if self.in_flight >= self.settings.max_routes_in_flight:  # overloaded: say so now, cheaply
            metrics.PLACEMENTS.labels("refused", "router_busy").inc()
            self.in_background(self.bus.respond(msg, RouteReply(
                request_id=RouteRequest.decode(msg.data).request_id, ok=False,
                reason=f"router busy ({self.in_flight} placements in flight)")))
            return
        self.in_background(self.on_route(msg))

    async def on_route(self, msg: Msg) -> None:
        req = RouteRequest.decode(msg.data)
        self.in_flight += 1
        with tracing.continued(self.tracer, "router.route", context_of(msg)) as span:
            span.set_attributes({"request_id": req.request_id, "prompt_tokens": len(req.prompt_token_ids),
                                 "router": self.id, "attempt": req.attempt})
            start = time.perf_counter()
            try:
                reply = await self.route(req)
            except Exception as e:  # Redis or NATS trouble: refuse clearly rather than hang the client
                # expected under overload or an outage: one line (a traceback per request would
                # cost more than the routes themselves); anything else: the traceback
                log.error("%s: routing failed: %r", req.request_id, e, exc_info=not isinstance(e, EXPECTED))
                reply = RouteReply(request_id=req.request_id, ok=False, reason=f"routing failed: {e}")
            finally:
                self.in_flight -= 1
            metrics.ROUTE_SECONDS.observe(time.perf_counter() - start)
            span.set_attributes({"ok": reply.ok, "mode": reply.mode or "", "reason": reply.reason,
                                 "decode_worker": reply.decode_worker or "",
                                 "prefill_worker": reply.prefill_worker or ""})
            await self.bus.respond(msg, reply)

    async def route(self, req: RouteRequest) -> RouteReply:
        """Place a request once, whichever replica is asked and however often (step 3)."""
        key = placement_key(req.request_id, req.attempt)  # a failover places anew
        lease_s = 2 * self.settings.admit_timeout_s + 1.0
        asked = time.perf_counter()
        ask, fleet = await self.inputs.of_route(req)
        plan = placement.decide(ask, fleet, self.bookings.books(time.monotonic()), self.rules)
        noted = plan.placement.decode.worker_id if plan.placement is not None else None
        while True:  # the claim, and the first choice noted with it
            claimed, known = await self.state.placements.begin(key, self.id, lease_s, noted or "", ROUTE_TTL_S)
            if "reply" in known:  # placed already (by this or another replica, maybe one since gone)
                trace.get_current_span().set_attribute("repeated", True)
                return RouteReply.decode(known["reply"].encode())
            if claimed:
                break
            await asyncio.sleep(0.05)
        trace.get_current_span().set_attribute("begin_ms", 1e3 * (time.perf_counter() - asked))  # Redis: claim
        if "decode" in known:  # taking over: the worker the lapsed claim's replica noted is asked first
            plan, noted = placement.decide(replace(ask, chosen_before=known["decode"]), fleet,
                                           self.bookings.books(time.monotonic()), self.rules), None
        waits = Waits(noted=noted)
        reply = await self.admits.ask(req, key, lease_s, plan, waits)
        if reply.ok:
            # the request's "routed" event, and the placement kept for repeats, in one round
            # trip the reply does not wait for: a repeat that comes first waits on the claim, and
            # a takeover after this replica died asks the decode worker noted (its admit is idempotent)
            answer = reply.encode().decode()
            self.state.requests.note(
                req.request_id, "routed", by=self.id, attempt=req.attempt, at=waits.admitted_at or None,
                prompt_tokens=ask.tokens, mode=reply.mode or "", reason=reply.reason,
                decode=reply.decode_worker or "", prefill=reply.prefill_worker or "",
                also=lambda p: self.state.placements.queue_note(p, key, ROUTE_TTL_S, reply=answer))
        else:  # refused: a later attempt decides afresh
            await self.state.placements.release(key)
        return reply


async def serve(settings: RouterSettings) -> None:
    tracer = tracing.setup("router", settings.otlp_endpoint, settings.trace_baggage_keys)
    metrics.serve(settings.metrics_port, settings.metrics_host)
    metrics_vllm.register(settings.model_name)
    async with AsyncExitStack() as stack:
        stop = stop_event()
        bus, state = await connect(stack, settings, "router", "router")
        await Router(settings, bus, state, tracer).serve(stop)
    tracing.shutdown()


def main(settings: RouterSettings | None = None) -> None:
    """The router with `settings` (`pdserve router`: its flags), else from the environment."""
    settings = settings or RouterSettings()
    setup_logging(settings, "router")
    run(serve(settings))


if __name__ == "__main__":
    main()
