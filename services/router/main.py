"""Router: decides where each request runs and admits it on a decode worker, naming its prefill worker.

1. Start: make sure the prefill work queue exists; join the `router` queue group on
   `pd.router.route` (several replicas share the requests).
2. Route (gateway → here): the live workers as last read from the registry (re-read in the
   background every 0.2 s; leases: a dead worker is simply absent); how many leading blocks of
   the prompt each worker holds, from the router's own copy of the prefix index
   (prefix_follower.py, fed by the workers' events: no I/O; with PD_PREFIX_INDEX=redis one
   Redis lookup, shared/prefix_index.py) and the conversation's worker (Redis, when the request
   has one); the decode worker, the prefill worker and local or remote prefill are decided in
   placement.py.
3. One Redis round trip claims the request and notes the first decode worker chosen, before it
   is asked (`placements.begin`). Admit on the decode worker first (it reserves KV blocks, or
   refuses and the next candidate is asked, its claim renewed and noted first), so no prefill is
   spent on a request that has nowhere to decode. One round trip after the reply (not awaited)
   stores it with the request's `routed` event.
4. Remote: the admit names the prefill worker; the decode worker puts the job on its queue
   (JetStream, kept until the prefill worker acks it after the KV handoff).
5. Reply to the gateway with the placement and its reason (also on the `router.route` span).
   Placement is idempotent by request id across replicas (a claim and the reply in Redis,
   `Router.route`): a repeated request gets the same answer and no second admit or job.
6. Breakers (breakers.py): every replica hears how each KV handoff ended (`pd.kv.outcomes`);
   a prefill → decode path that keeps failing is avoided for a cooldown, then probed.
7. Requeue (requeue.py): the prefill worker computing a request's KV is gone or late; another
   is chosen for the same decode worker (or none: the decode worker prefills it). Admits and
   requeues carry the prefill's predicted time: the decode worker's KV deadline follows it.
8. Supervisor (supervisor.py): requests past their phase's deadline with their workers alive
   → the gateway is told to move them; requests whose gateway is gone → cancelled.
9. Background: the registry re-read; the workers' prefix events applied and their snapshots
   taken as needed (with PD_PREFIX_INDEX=redis: a step of sweeping dead workers' entries out of
   the Redis index, replicas taking turns).
10. SIGTERM: leave the queue group, finish the routes in flight, drain NATS.
Routes run concurrently (a task each): an admit that waits on a dying worker delays only its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace

import nats.errors
from nats.aio.msg import Msg
from opentelemetry import trace
from redis.asyncio.client import Pipeline

from services.router import placement, policy
from services.router.bookings import Bookings
from services.router.breakers import Breakers
from services.router.errors import EXPECTED
from services.router.placement import Ask, Fleet, Placement, Rules
from services.router.pools import Pool, Pools
from services.router.prefix_follower import PrefixFollower
from services.router.registry import Bounds
from services.router.requeue import on_requeue
from services.router.supervisor import Supervisor
from shared import identity, metrics, metrics_vllm, prefix_index, subjects, tracing
from shared.bus import Bus, context_of
from shared.config import RouterSettings
from shared.hashing import block_hashes
from shared.messages import AdmitReply, AdmitRequest, KVOutcome, RouteReply, RouteRequest, WorkerInfo
from shared.service import connect, heartbeat, run, serving, setup_logging, stop_event
from shared.state import State, placement_key, session_key
from shared.tasks import Background, every

log = logging.getLogger("router")
ROUTE_TTL_S = 600.0  # a placement is answered again for this long (a retried or repeated request)
GONE_LEASES = 10     # events: a worker's entries are dropped once it has been out of the registry this many leases


@dataclass
class Waits:
    """A placement's time in others' hands (span attributes: the router's own time is the rest)."""

    noted: str | None = None  # the decode worker noted with the claim (`placements.begin`): its admit needs no hold
    hold_s: float = 0.0   # renewing the claim in Redis
    admit_s: float = 0.0  # the decode workers answering admits
    admitted_at: float = 0.0  # wall time the admit that was taken went out: the `routed` event's time (the
    #                           decode worker queues the prefill at once: its `prefilling` may be noted first)


class Router:
    def __init__(self, settings: RouterSettings, bus: Bus, state: State, tracer: trace.Tracer):
        self.settings, self.bus, self.state, self.tracer = settings, bus, state, tracer
        self.pools = Pools(state, settings.stall_s,
                           Bounds(settings.max_worker_blocks, settings.max_prefill_tokens_per_s))
        self.rules = Rules.of(settings)
        self.in_flight = 0       # placements being worked on
        self.id = identity.instance_id("router", settings.enroll_token, settings.router_id,
                                       f"router-{uuid.uuid4().hex[:8]}")
        self._background = Background(log, "background step")  # Redis or NATS away: logged, not fatal
        self.breakers = Breakers(settings.breaker_failures, settings.breaker_window_s, settings.breaker_cooldown_s)
        self.bookings = Bookings(settings.heartbeat_s, self.breakers)
        # PD_PREFIX_INDEX=events: the prefix index in this router's memory, fed by the workers' events
        self.follower = PrefixFollower(bus, self.id, self.pools.registered, GONE_LEASES * settings.lease_s) \
            if settings.prefix_index == "events" else None

    async def read_workers(self) -> dict[str, Pool]:
        return await self.pools.read()

    def in_background(self, coro: Coroutine) -> None:
        self._background.start(coro)

    async def serve(self, stop: asyncio.Event) -> None:
        await self.bus.wait_stream(subjects.PREFILL_STREAM)
        # each route in its own task: one slow admit (a worker that just died) holds up no other
        sub = await self.bus.subscribe(subjects.ROUTE, self.start_route, queue=subjects.ROUTER_QUEUE)
        requeues = await self.bus.subscribe(subjects.REQUEUE, self.start_requeue, queue=subjects.ROUTER_QUEUE)
        await self.bus.subscribe(subjects.KV_OUTCOMES, self.on_kv_outcome)  # every replica: all outcomes
        me = WorkerInfo(worker_id=self.id, role="router")
        beat = asyncio.create_task(heartbeat(self.state, lambda: me, self.settings.heartbeat_s, stop))
        supervisor = Supervisor(self.bus, self.state, self.id, self.settings.stall_s, self.settings.lease_s,
                                registered=self.pools.registered)
        supervising = asyncio.create_task(supervisor.run(stop, self.settings.supervise_s))
        registry = asyncio.create_task(self.pools.keep(stop))
        if self.follower is not None:  # events: the index in memory
            await self.follower.start()
            self._background.start(self.follower.keep(stop))
        else:  # redis: dead workers' entries swept out of it
            self._background.start(every(self.settings.supervise_s, lambda: prefix_index.sweep(
                self.state, self.id, self.settings.supervise_s), stop, log, "prefix index sweep"))
        log.info("router ready")
        serving()
        await stop.wait()
        await asyncio.gather(beat, supervising, registry)
        await self.state.registry.deregister(me.worker_id)
        await sub.drain()
        await requeues.drain()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.follower is not None:
            await self.follower.close()

    async def start_requeue(self, msg: Msg) -> None:
        self.in_background(on_requeue(self, msg))

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
        """Place a request once, whichever replica is asked and however often: a router claims
        the request in Redis before asking a decode worker; a repeat gets the placement already
        made, or waits while another replica decides. If that replica dies mid-decision its claim
        lapses and this one takes over, trying the decode worker it had noted first (an admit is
        idempotent there, and the prefill job is deduplicated by its message id)."""
        key = placement_key(req.request_id, req.attempt)  # a failover places anew
        lease_s = 2 * self.settings.admit_timeout_s + 1.0
        pool = await self.pools.pool(req.model)
        # the engine always computes the last prompt token: only the blocks before it can hit (a
        # failover's prompt is the prompt and the tokens streamed before it)
        hashes = block_hashes([*req.prompt_token_ids, *req.generated_token_ids][:-1], pool.block_size,
                              req.sampling.cache_salt)
        asked = time.perf_counter()
        session_worker, held = await self.read_inputs(hashes, req.session_id)
        ask, fleet = Ask.of(req, session_worker), Fleet.of(pool, await self.holding(pool, hashes, held))
        first = placement.first(ask, fleet, self.bookings.books(time.monotonic()), self.rules)
        while True:  # the claim, and the first choice noted with it (a takeover's asks the noted one)
            claimed, known = await self.state.placements.begin(key, self.id, lease_s,
                                                               first.worker_id if first else "", ROUTE_TTL_S)
            if "reply" in known:  # placed already (by this or another replica, maybe one since gone)
                return self.repeated(known)
            if claimed:
                break
            await asyncio.sleep(0.05)
        trace.get_current_span().set_attribute("begin_ms", 1e3 * (time.perf_counter() - asked))  # Redis: claim
        if "decode" in known:  # taking over: the worker the lapsed claim's replica noted is asked first
            ask, first = replace(ask, chosen_before=known["decode"]), None
        waits = Waits(noted=first.worker_id if first is not None else None)
        reply = await self.place(req, key, lease_s, ask, fleet, waits, first)
        if reply.ok:
            # the request's "routed" event, and the placement kept for repeats, in one round
            # trip the reply does not wait for: a repeat that comes first waits on the claim, and
            # a takeover after this replica died asks the decode worker noted (its admit is idempotent)
            answer = reply.encode().decode()
            self.state.requests.note(
                req.request_id, "routed", by=self.id, attempt=req.attempt, at=waits.admitted_at or None,
                prompt_tokens=len(req.prompt_token_ids) + len(req.generated_token_ids),
                mode=reply.mode or "", reason=reply.reason, decode=reply.decode_worker or "",
                prefill=reply.prefill_worker or "",
                also=lambda p: self.state.placements.queue_note(p, key, ROUTE_TTL_S, reply=answer))
        else:  # refused: a later attempt decides afresh
            await self.state.placements.release(key)
        return reply

    async def read_inputs(self, hashes: list[int], session_id: str | None) -> tuple[str | None, dict[int, int] | None]:
        """What a placement reads from Redis before deciding, in one round trip, or none when it
        reads nothing there (the prefix index in memory, no conversation): (the conversation's
        worker, the prefix index's answer by slot: PD_PREFIX_INDEX=redis)."""
        lookup = bool(hashes) and self.follower is None
        if not lookup and not session_id:
            return None, None

        def build(p: Pipeline) -> None:
            if lookup:
                prefix_index.queue_lookup(self.state, p, hashes)
            if session_id:
                p.get(session_key(session_id))
        answers = iter(await self.state.pipelined(build))
        held = prefix_index.held_by_slot(next(answers)) if lookup else None
        session = next(answers) if session_id else None
        return session.decode() if session else None, held

    async def holding(self, pool: Pool, hashes: list[int], held: dict[int, int] | None = None
                      ) -> dict[str, tuple[int, int]]:
        """The pool's workers holding some of the prompt (prefix_index.by_worker): from the memory
        index (PD_PREFIX_INDEX=events), else from Redis's answer by slot — `held`, read before
        deciding (`read_inputs`), or asked now."""
        if self.follower is not None:
            return prefix_index.by_worker(pool.ids, self.follower.lookup(hashes))
        if held is None:
            held = await prefix_index.lookup(self.state, hashes) if hashes else {}
        return prefix_index.by_worker(pool.slots, held)

    @staticmethod
    def repeated(known: dict[str, str]) -> RouteReply:
        trace.get_current_span().set_attribute("repeated", True)
        return RouteReply.decode(known["reply"].encode())

    async def place(self, req: RouteRequest, key: str, lease_s: float, ask: Ask, fleet: Fleet[WorkerInfo],
                    waits: Waits, first: WorkerInfo | None = None) -> RouteReply:
        """Ask the decode workers best first until one admits the request with the prefill planned
        for it (placement.plan, `try_admit`), then `commit`: `first` (placement.first, decided before
        the claim), then, only when it refuses, the rest as placement.rank orders them. `fleet.cached`:
        the workers holding some of the prompt (prefix_index.by_worker); `waits`: the time spent in
        others' hands."""
        for decode in self.candidates(ask, fleet, first):
            books = self.bookings.books(time.monotonic(), decode.worker_id)
            chosen = placement.plan(ask, decode, fleet, books, self.rules)
            if chosen.prefill is not None and not req.attempt:  # remote: the pool's queue may be too long
                admit_ok, retry_after, why_not = policy.within_objective(
                    policy.predicted_prefill_s(chosen.prefill, len(req.prompt_token_ids)), self.settings.ttft_slo_s)
                if not admit_ok:
                    metrics.PLACEMENTS.labels("refused", "ttft_objective").inc()
                    return RouteReply(request_id=req.request_id, ok=False, reason=why_not, retry_after_s=retry_after)
            if await self.try_admit(req, key, lease_s, chosen, waits):
                return self.commit(req, chosen, fleet.cached_tokens(decode.worker_id), ask.session_worker, waits)
        reason = "no decode worker is up" if not fleet.decodes else "no decode worker has room for this request now"
        metrics.PLACEMENTS.labels("refused", "no_decode_worker" if not fleet.decodes else "no_room").inc()
        return RouteReply(request_id=req.request_id, ok=False, reason=reason)

    def candidates(self, ask: Ask, fleet: Fleet[WorkerInfo], first: WorkerInfo | None) -> Iterator[WorkerInfo]:
        """The decode workers to ask in turn: `first`, then the ranking (made only if it is needed)."""
        if first is not None:
            yield first
        for decode in placement.rank(ask, fleet, self.bookings.books(time.monotonic()), self.rules):
            if first is None or decode.worker_id != first.worker_id:
                yield decode

    async def try_admit(self, req: RouteRequest, key: str, lease_s: float, chosen: Placement, waits: Waits
                        ) -> bool:
        """Book the prefill work (routes decided meanwhile see it), renew the claim noting the
        worker asked, and ask it; a refusal or no answer takes the booking back."""
        prefill = chosen.prefill
        booked = None
        if prefill is not None:
            booked = self.bookings.prefill(prefill, chosen.decode.worker_id, len(req.prompt_token_ids),
                                           time.monotonic())
            self.bookings.tried(chosen)
        asked = time.perf_counter()  # renew the claim (each admit may take its timeout) and note the worker asked
        if chosen.decode.worker_id != waits.noted:  # (noted with the claim: just now)
            await self.state.placements.hold(key, self.id, lease_s, chosen.decode.worker_id, ROUTE_TTL_S)
        waits.noted = None
        waits.hold_s += time.perf_counter() - asked
        asked, sent_at = time.perf_counter(), time.time()
        expected_s = policy.predicted_prefill_s(prefill, len(req.prompt_token_ids) + len(req.generated_token_ids)) \
            if prefill is not None else 0.0
        admit = await self.admit(chosen.decode, req, chosen.mode,
                                 prefill.worker_id if prefill is not None else None, expected_s)
        waits.admit_s += time.perf_counter() - asked
        if admit is not None and admit.ok:
            waits.admitted_at = sent_at
            return True
        if booked:
            self.bookings.sent.cancel(booked)
        return False

    def commit(self, req: RouteRequest, chosen: Placement, decode_cached_tokens: int,
               session_worker: str | None, waits: Waits) -> RouteReply:
        """The decode worker admitted the request (and queued its prefill job when remote)."""
        decode, prefill = chosen.decode, chosen.prefill
        self.bookings.admitted.add(decode.worker_id, 1, time.monotonic())
        span = trace.get_current_span()
        if prefill is not None:
            span.set_attributes({"prefill_cached_tokens": prefill.cached_tokens,
                                 "prefill_queued_tokens": prefill.queued_tokens})
        span.set_attributes({"decode_cached_tokens": decode_cached_tokens, "session_worker": session_worker or "",
                             "admit_wait_ms": 1e3 * waits.admit_s, "hold_ms": 1e3 * waits.hold_s})
        if req.session_id:
            self.in_background(self.state.sessions.set_worker(req.session_id, decode.worker_id,
                                                             self.settings.session_ttl_s))
        metrics.PLACEMENTS.labels(chosen.mode, chosen.kind).inc()
        return RouteReply(request_id=req.request_id, ok=True, mode=chosen.mode, reason=chosen.reason,
                          decode_worker=decode.worker_id,
                          prefill_worker=prefill.worker_id if prefill is not None else None)

    async def admit(self, decode: WorkerInfo, req: RouteRequest, mode: str,
                    prefill_worker: str | None, expected_prefill_s: float = 0.0) -> AdmitReply | None:
        msg = AdmitRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                           mode=mode, prefill_worker=prefill_worker, generated_token_ids=req.generated_token_ids,
                           attempt=req.attempt, expected_prefill_s=expected_prefill_s,
                           secret=req.secret)
        try:
            return await self.bus.request(subjects.decode_admit(decode.worker_id), msg, AdmitReply,
                                          timeout=self.settings.admit_timeout_s)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            log.warning("%s: decode worker %s did not answer the admit", req.request_id, decode.worker_id)
            return None


async def serve(settings: RouterSettings) -> None:
    tracer = tracing.setup("router", settings.otlp_endpoint, settings.trace_baggage_keys)
    metrics.serve(settings.metrics_port)
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
