"""Router: decides where each request runs and admits it on a decode worker, naming its prefill worker.

1. Start: make sure the prefill work queue exists; join the `router` queue group on
   `pd.router.route` (several replicas share the requests).
2. Route (gateway → here): the live workers as last read from the registry (re-read in the
   background every 0.2 s; leases: a dead worker is simply absent); in one Redis round trip
   claim the request, look its prompt up in the prefix index (shared/prefix_index.py: how
   many leading blocks each worker holds) and read its conversation's worker; decide local or
   remote prefill and pick the decode worker and the prefill worker by cost (policy.py).
3. Admit on the decode worker first (it reserves KV blocks, or refuses and the next
   candidate is asked), so no prefill is spent on a request that has nowhere to decode. One
   round trip before each admit renews the claim and notes the worker asked; one after the
   reply (not awaited) stores it with the request's `routed` event.
4. Remote: the admit names the prefill worker; the decode worker puts the job on its queue
   (JetStream, kept until the prefill worker acks it after the KV handoff).
5. Reply to the gateway with the placement and its reason (also on the `router.route` span).
   Placement is idempotent by request id across replicas (a claim and the reply in Redis,
   `Router.route`): a repeated request gets the same answer and no second admit or job.
6. Breakers: every replica hears how each KV handoff ended (`pd.kv.outcomes`); a prefill →
   decode path that keeps failing is avoided for a cooldown (another prefill worker, or a
   local prefill), then probed (policy.Breaker).
7. Requeue (decode worker → here, `pd.router.requeue`): the prefill worker computing a
   request's KV is gone or late; another is chosen as in step 2 for the same decode worker
   (or none: the decode worker prefills it), and recorded as the request's `routed` again.
   Admits and requeues carry the prefill's predicted time (the worker's queue and the
   prompt's uncached part at its measured rate): the decode worker's KV deadline follows it.
8. Supervisor (supervisor.py): requests past their phase's deadline with their workers alive
   → the gateway is told to move them; requests whose gateway is gone → cancelled.
9. Background: the registry re-read; a step of sweeping dead workers' entries out of the
   prefix index (replicas take turns).
10. SIGTERM: leave the queue group, finish the routes in flight, drain NATS.
Routes run concurrently (a task each): an admit that waits on a dying worker delays only its own.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace

import nats.errors
from nats.aio.msg import Msg
from opentelemetry import trace
from redis.exceptions import RedisError

from services.router import policy
from services.router.pools import EMPTY, Pool, pools
from services.router.recent import REGISTRY_READ_S, Recent, horizons
from services.router.registry import Registry
from services.router.supervisor import Supervisor
from shared import metrics, metrics_vllm, prefix_index, subjects, tracing
from shared.bus import Bus, context_of
from shared.config import RouterSettings
from shared.hashing import block_hashes
from shared.messages import (
    AdmitReply,
    AdmitRequest,
    KVOutcome,
    Requeue,
    Requeued,
    RouteReply,
    RouteRequest,
    WorkerInfo,
)
from shared.service import connect, heartbeat, run, serving, setup_logging, stop_event
from shared.state import State, placement_key, route_key, session_key
from shared.tasks import Background, every

log = logging.getLogger("router")
# a lease (3 heartbeats): a registry copy older than this (the background read not done yet, or
# failing) is read on the route
WORKERS_MAX_AGE_S = 3.0
EXPECTED = (RedisError, asyncio.TimeoutError, nats.errors.Error)  # failures of a store or bus, not of the code
ROUTE_TTL_S = 600.0  # a placement is answered again for this long (a retried or repeated request)


@dataclass(frozen=True)
class Placement:
    """Where a request would go: its decode worker and, when prefilled remotely, its prefill
    worker; why (the reply's reason) and the kind of reason (a metric label)."""

    decode: WorkerInfo
    mode: policy.Mode
    reason: str
    kind: str
    prefill: policy.PrefillCandidate | None = None  # set exactly when mode == "remote"


@dataclass
class Waits:
    """A placement's time in others' hands (span attributes: the router's own time is the rest)."""

    hold_s: float = 0.0   # renewing the claim in Redis
    admit_s: float = 0.0  # the decode workers answering admits
    admitted_at: float = 0.0  # wall time the admit that was taken went out: the `routed` event's time (the
    #                           decode worker queues the prefill at once: its `prefilling` may be noted first)


class Router:
    def __init__(self, settings: RouterSettings, bus: Bus, state: State, tracer: trace.Tracer):
        self.settings, self.bus, self.state, self.tracer = settings, bus, state, tracer
        self._pools: tuple[float, dict[str, Pool]] = (-math.inf, {})  # never read
        self.registry = Registry()
        self.refreshing = False  # keep_workers runs
        self.in_flight = 0       # placements being worked on
        # counted on top of what each worker's registry entry shows until that entry has caught up
        sent_s, admitted_s = horizons(settings.heartbeat_s)
        self.sent, self.admitted = Recent(sent_s), Recent(admitted_s)  # prefill tokens sent, requests admitted
        self.turn = 0  # remote placements so far (round-robin baseline)
        self.id = settings.router_id or f"router-{uuid.uuid4().hex[:8]}"
        self._background = Background(log, "background step")  # Redis or NATS away: logged, not fatal
        self.breakers: dict[tuple[str, str], policy.Breaker] = {}  # (prefill, decode) KV paths
        self.tripped: dict[str, set[str]] = {}  # decode worker -> prefill workers whose path's breaker is not closed

    async def pool(self, model: str) -> Pool:
        """The model's workers in the live registry as last read: kept fresh by `keep_workers`
        while the router serves (a placement never waits for it); read here when older than
        REGISTRY_READ_S otherwise. Heartbeats are 1 s apart: a stale entry costs one refused
        admit, which moves on."""
        fetched_at, by_model = self._pools
        age = time.monotonic() - fetched_at
        if age > REGISTRY_READ_S and (not self.refreshing or age > WORKERS_MAX_AGE_S):
            by_model = await self.read_workers()
        return by_model.get(model, EMPTY)

    async def read_workers(self) -> dict[str, Pool]:
        now = time.monotonic()
        await self.registry.read(self.state)
        workers = [w for w in self.registry.workers() if w.role in ("prefill", "decode") and not w.draining
                   and w.step_s < self.settings.stall_s]  # a step running that long: hung
        self._pools = (now, pools(workers))
        return self._pools[1]

    async def registered(self) -> list[WorkerInfo]:
        """Every registered worker, gateway and router, as last read (read now if that is older
        than a lease: the background read is not running or failing)."""
        if time.monotonic() - self._pools[0] > WORKERS_MAX_AGE_S:
            await self.read_workers()
        return self.registry.workers()

    async def keep_workers(self, stop: asyncio.Event) -> None:
        self.refreshing = True
        try:
            await every(REGISTRY_READ_S, self.read_workers, stop, log, "registry read")
        finally:
            self.refreshing = False

    def in_background(self, coro) -> None:
        self._background.start(coro)

    async def serve(self, stop: asyncio.Event) -> None:
        await self.bus.ensure_prefill_stream(self.settings.stream_replicas)
        # each route in its own task: one slow admit (a worker that just died) holds up no other
        sub = await self.bus.subscribe(subjects.ROUTE, self.start_route, queue=subjects.ROUTER_QUEUE)
        requeues = await self.bus.subscribe(subjects.REQUEUE, self.start_requeue, queue=subjects.ROUTER_QUEUE)
        await self.bus.subscribe(subjects.KV_OUTCOMES, self.on_kv_outcome)  # every replica: all outcomes
        me = WorkerInfo(worker_id=self.id, role="router")
        beat = asyncio.create_task(heartbeat(self.state, lambda: me, self.settings.heartbeat_s, stop))
        supervisor = Supervisor(self.bus, self.state, self.id, self.settings.stall_s, self.settings.lease_s,
                                registered=self.registered)
        supervising = asyncio.create_task(supervisor.run(stop, self.settings.supervise_s))
        registry = asyncio.create_task(self.keep_workers(stop))
        sweeping = asyncio.create_task(every(self.settings.supervise_s, lambda: prefix_index.sweep(
            self.state, self.id, self.settings.supervise_s), stop, log, "prefix index sweep"))
        log.info("router ready")
        serving()
        await stop.wait()
        await asyncio.gather(beat, supervising, registry, sweeping)
        await self.state.deregister(me.worker_id)
        await sub.drain()
        await requeues.drain()
        await asyncio.gather(*self._background, return_exceptions=True)

    def breaker(self, prefill: str, decode: str) -> policy.Breaker:
        key = (prefill, decode)
        if key not in self.breakers:
            s = self.settings
            self.breakers[key] = policy.Breaker(s.breaker_failures, s.breaker_window_s, s.breaker_cooldown_s)
        return self.breakers[key]

    async def on_kv_outcome(self, msg: Msg) -> None:
        out = KVOutcome.decode(msg.data)
        b = self.breaker(out.prefill_worker, out.decode_worker)
        before = b.state
        b.record(out.ok, time.monotonic())
        tripped = self.tripped.setdefault(out.decode_worker, set())
        if b.opened_at is None:
            tripped.discard(out.prefill_worker)
        else:
            tripped.add(out.prefill_worker)
        if b.state != before:
            log.warning("KV path %s -> %s: breaker %s (%s)", out.prefill_worker, out.decode_worker, b.state,
                        out.reason or "ok")

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
        the request in Redis before deciding; a repeat gets the placement already made, or
        waits while another replica decides. If that replica dies mid-decision its claim
        lapses and this one takes over, trying the decode worker it had chosen first (an
        admit is idempotent there, and the prefill job is deduplicated by its message id)."""
        key = placement_key(req.request_id, req.attempt)  # a failover places anew
        lease_s = 2 * self.settings.admit_timeout_s + 1.0
        pool = await self.pool(req.model)
        # the engine always computes the last prompt token: only the blocks before it can hit (a
        # failover's prompt is the prompt and the tokens streamed before it)
        hashes = block_hashes([*req.prompt_token_ids, *req.generated_token_ids][:-1], pool.block_size,
                              req.sampling.cache_salt)
        asked = time.perf_counter()
        while True:
            claimed, known, held, session_worker = await self.begin(key, lease_s, hashes, req.session_id)
            if "reply" in known:  # placed already (by this or another replica, maybe one since gone)
                return self.repeated(known)
            if claimed:
                break
            await asyncio.sleep(0.05)
        trace.get_current_span().set_attribute("begin_ms", 1e3 * (time.perf_counter() - asked))  # Redis: claim, lookup
        waits = Waits()
        reply = await self.place(req, key, known.get("decode"), lease_s, pool,
                                 prefix_index.by_worker(pool.slots, held), session_worker, waits)
        if reply.ok:
            # the request's "routed" event, and the placement kept for repeats, in one round
            # trip the reply does not wait for: a repeat that comes first waits on the claim, and
            # a takeover after this replica died asks the decode worker noted by hold_route (its
            # admit is idempotent)
            answer = reply.encode().decode()
            self.state.note(req.request_id, "routed", by=self.id, attempt=req.attempt, at=waits.admitted_at or None,
                            prompt_tokens=len(req.prompt_token_ids) + len(req.generated_token_ids),
                            mode=reply.mode or "", reason=reply.reason, decode=reply.decode_worker or "",
                            prefill=reply.prefill_worker or "",
                            also=lambda p: self.state.queue_note_route(p, key, ROUTE_TTL_S, reply=answer))
        else:  # refused: a later attempt decides afresh
            await self.state.release_route(key)
        return reply

    async def begin(self, key: str, lease_s: float, hashes: list[int], session_id: str | None
                    ) -> tuple[bool, dict[str, str], dict[int, int], str | None]:
        """One round trip: claim the placing, read what is known of it, look the prompt up in
        the prefix index and read the conversation's worker. (claimed, known, held by slot, session worker)"""
        def build(p):
            self.state.queue_claim_route(p, key, self.id, lease_s)
            p.hgetall(route_key(key))
            if hashes:
                prefix_index.queue_lookup(self.state, p, hashes)
            if session_id:
                p.get(session_key(session_id))
        answers = iter(await self.state.pipelined(build))
        claimed, known = bool(next(answers)), {k.decode(): v.decode() for k, v in next(answers).items()}
        held = prefix_index.held_by_slot(next(answers)) if hashes else {}
        session = next(answers) if session_id else None
        return claimed, known, held, session.decode() if session else None

    @staticmethod
    def repeated(known: dict[str, str]) -> RouteReply:
        trace.get_current_span().set_attribute("repeated", True)
        return RouteReply.decode(known["reply"].encode())

    async def place(self, req: RouteRequest, key: str, chosen_before: str | None, lease_s: float,
                    pool: Pool, cached: dict[str, tuple[int, int]], session_worker: str | None, waits: Waits
                    ) -> RouteReply:
        """Ask the decode workers best first (`rank`) until one admits the request with the
        prefill `plan`ned for it (`try_admit`), then `commit`. `cached`: the workers holding some
        of the prompt (prefix_index.by_worker); `waits`: the time spent in others' hands."""
        for decode in self.rank(req, pool, cached, session_worker, chosen_before):
            placement = self.plan(req, decode, pool, cached)
            if placement.prefill is not None and not req.attempt:  # remote: the pool's queue may be too long
                admit_ok, retry_after, why_not = policy.within_objective(
                    policy.predicted_prefill_s(placement.prefill, len(req.prompt_token_ids)), self.settings.ttft_slo_s)
                if not admit_ok:
                    metrics.PLACEMENTS.labels("refused", "ttft_objective").inc()
                    return RouteReply(request_id=req.request_id, ok=False, reason=why_not, retry_after_s=retry_after)
            if await self.try_admit(req, key, lease_s, placement, waits):
                return self.commit(req, placement, cached.get(decode.worker_id, (0, 0))[0] * pool.block_size,
                                   session_worker, waits)
        reason = "no decode worker is up" if not pool.decodes else "no decode worker has room for this request now"
        metrics.PLACEMENTS.labels("refused", "no_decode_worker" if not pool.decodes else "no_room").inc()
        return RouteReply(request_id=req.request_id, ok=False, reason=reason)

    def rank(self, req: RouteRequest, pool: Pool, cached: dict[str, tuple[int, int]], session_worker: str | None,
             chosen_before: str | None) -> list[WorkerInfo]:
        """The decode workers to ask, best first (policy.decode_candidates); those the request
        asks to avoid last; when taking over a placement, the worker already asked first (it may
        hold the request)."""
        block_size = pool.block_size
        blocks = -(-(len(req.prompt_token_ids) + len(req.generated_token_ids) + 1) // block_size)
        ranked = policy.decode_candidates(pool.decodes, blocks, {w: n * block_size for w, (n, _) in cached.items()},
                                          len(req.prompt_token_ids), session_worker, self.settings.affinity_slack,
                                          output_blocks=-(-req.sampling.max_tokens // block_size),
                                          booked=self.admitted.totals(time.monotonic()))
        ranked = sorted(ranked, key=lambda w: w.worker_id in req.avoid_workers)  # stable: avoided ones last
        if chosen_before:
            ranked = [w for w in pool.decodes if w.worker_id == chosen_before] + [
                w for w in ranked if w.worker_id != chosen_before]
        return ranked

    def plan(self, req: RouteRequest, decode: WorkerInfo, pool: Pool, cached: dict[str, tuple[int, int]]
             ) -> Placement:
        """Where the prompt is prefilled if `decode` takes the request. A failover's prompt is
        the prompt and the tokens streamed before it: placed like a new request's, so a prefill
        worker computes it (the one that prefilled the prompt holds it in its cache, and then
        computes only the tokens streamed since) and `decode` continues from its KV."""
        generated = req.generated_token_ids
        placement = self.place_prefill(len(req.prompt_token_ids) + len(generated), decode, pool.prefills, cached,
                                       cached.get(decode.worker_id, (0, 0))[0] * pool.block_size)
        if not generated:
            return placement
        return replace(placement, kind="resumed", reason=f"resumed after {len(generated)} tokens "
                                                         f"(attempt {req.attempt}): {placement.reason}")

    async def try_admit(self, req: RouteRequest, key: str, lease_s: float, placement: Placement, waits: Waits
                        ) -> bool:
        """Book the prefill work (routes decided meanwhile see it), renew the claim noting the
        worker asked, and ask it; a refusal or no answer takes the booking back."""
        prefill = placement.prefill
        booked = None
        if prefill is not None:
            booked = self.book_prefill(prefill, placement.decode.worker_id, len(req.prompt_token_ids))
            self.turn += 1
        asked = time.perf_counter()  # renew the claim (each admit may take its timeout) and note the worker asked
        await self.state.hold_route(key, self.id, lease_s, placement.decode.worker_id, ROUTE_TTL_S)
        waits.hold_s += time.perf_counter() - asked
        asked, sent_at = time.perf_counter(), time.time()
        expected_s = policy.predicted_prefill_s(prefill, len(req.prompt_token_ids) + len(req.generated_token_ids)) \
            if prefill is not None else 0.0
        admit = await self.admit(placement.decode, req, placement.mode,
                                 prefill.worker_id if prefill is not None else None, expected_s)
        waits.admit_s += time.perf_counter() - asked
        if admit is not None and admit.ok:
            waits.admitted_at = sent_at
            return True
        if booked:
            self.sent.cancel(booked)
        return False

    def book_prefill(self, prefill: policy.PrefillCandidate, decode: str, prompt_tokens: int) -> list:
        """A prompt sent to `prefill` for `decode`: its uncached tokens counted on that worker's
        queue (routes decided meanwhile see them until its registry entry catches up) and the
        path's breaker told; returns the booking, to take back if the admit is refused."""
        now = time.monotonic()
        self.breaker(prefill.worker_id, decode).chosen(now)
        return self.sent.add(prefill.worker_id, prompt_tokens - prefill.cached_tokens, now)

    def commit(self, req: RouteRequest, placement: Placement, decode_cached_tokens: int,
               session_worker: str | None, waits: Waits) -> RouteReply:
        """The decode worker admitted the request (and queued its prefill job when remote)."""
        decode, prefill = placement.decode, placement.prefill
        self.admitted.add(decode.worker_id, 1, time.monotonic())
        span = trace.get_current_span()
        if prefill is not None:
            span.set_attributes({"prefill_cached_tokens": prefill.cached_tokens,
                                 "prefill_queued_tokens": prefill.queued_tokens})
        span.set_attributes({"decode_cached_tokens": decode_cached_tokens, "session_worker": session_worker or "",
                             "admit_wait_ms": 1e3 * waits.admit_s, "hold_ms": 1e3 * waits.hold_s})
        if req.session_id:
            self.in_background(self.state.set_session_worker(req.session_id, decode.worker_id,
                                                             self.settings.session_ttl_s))
        metrics.PLACEMENTS.labels(placement.mode, placement.kind).inc()
        return RouteReply(request_id=req.request_id, ok=True, mode=placement.mode, reason=placement.reason,
                          decode_worker=decode.worker_id,
                          prefill_worker=prefill.worker_id if prefill is not None else None)

    def place_prefill(self, prompt_tokens: int, decode: WorkerInfo, prefills: list[WorkerInfo],
                      cached: dict[str, tuple[int, int]], decode_cached_tokens: int) -> Placement:
        """For a prompt bound to `decode`: the prefill worker, local or remote, and why."""
        now = time.monotonic()
        tripped = self.tripped.get(decode.worker_id)  # paths not closed (only those need asking)
        healthy = [p for p in prefills if p.worker_id not in tripped or self.breaker(p.worker_id, decode.worker_id)
                   .allow(now)] if tripped else prefills
        if prefills and not healthy:  # every path to this decode worker failing: colocated until it heals
            return Placement(decode, "local", f"KV paths to {decode.worker_id} failing (breaker open): prefilled "
                                              "there", "breaker_open")
        candidates = policy.prefill_candidates(healthy, decode.fingerprint, cached, self.sent.totals(time.monotonic()),
                                               self.settings.default_prefill_tokens_per_s)
        if self.settings.prefill_policy == "round_robin":
            prefill, why = policy.choose_round_robin(candidates, self.turn)
        else:
            prefill, why = policy.choose_prefill_by_cost(candidates, prompt_tokens, self.settings.recompute_weight)
        mode, reason = policy.prefill_mode(prompt_tokens, int(prefill is not None), self.settings.local_prefill_below)
        if prefill is None or mode == "local":
            return Placement(decode, "local", reason, "no_prefill_worker" if prefill is None else "short_prompt")
        kind = "round_robin" if self.settings.prefill_policy == "round_robin" else \
            "cached_prefix" if prefill.cached_tokens else "least_loaded"
        if self.settings.prefill_mode == "cost":
            mode, reason = policy.local_or_remote(
                prompt_tokens, decode_cached_tokens, decode.running,
                decode.prefill_tokens_per_s or self.settings.default_prefill_tokens_per_s, prefill,
                self.settings.stall_weight, self.settings.pool_queue_factor)
            if mode == "local":
                return Placement(decode, "local", reason, "cheaper_locally")
            return Placement(decode, "remote", f"{why}; {reason}", kind, prefill)
        return Placement(decode, "remote", why, kind, prefill)

    async def start_requeue(self, msg: Msg) -> None:
        self.in_background(self.on_requeue(msg))

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
        """A decode worker holding a reservation lost the prefill worker computing its KV: the
        prompt's prefill is placed again, onto that decode worker, among the other prefill
        workers (`place_prefill`, as for a new request: prefix index, queues, breakers) — or
        on the decode worker itself when none fits (short prompt, breakers open, none left)."""
        pool = await self.pool(req.model)
        decode = next((w for w in self.registry.workers() if w.worker_id == req.decode_worker), None)
        if decode is None:
            return Requeued(request_id=req.request_id, reason=f"decode worker {req.decode_worker} not registered")
        tokens = [*req.prompt_token_ids, *req.generated_token_ids]
        hashes = block_hashes(tokens[:-1], pool.block_size, req.cache_salt)
        held = await prefix_index.lookup(self.state, hashes)
        cached = prefix_index.by_worker(pool.slots, held)
        others = [p for p in pool.prefills if p.worker_id not in req.avoid_workers]
        placement = self.place_prefill(len(tokens), decode, others, cached,
                                       cached.get(decode.worker_id, (0, 0))[0] * pool.block_size)
        prefill = placement.prefill
        metrics.PLACEMENTS.labels(placement.mode, "requeued").inc()
        if prefill is None:
            return Requeued(request_id=req.request_id, reason=placement.reason)
        expected_s = policy.predicted_prefill_s(prefill, len(tokens))
        self.book_prefill(prefill, decode.worker_id, len(tokens))
        reason = f"requeued from {req.avoid_workers[-1]} ({req.why}): {placement.reason}"
        self.state.note(req.request_id, "routed", by=self.id, attempt=req.attempt, prompt_tokens=len(tokens),
                        mode="remote", reason=reason, decode=decode.worker_id, prefill=prefill.worker_id)
        return Requeued(request_id=req.request_id, prefill_worker=prefill.worker_id, reason=reason,
                        expected_prefill_s=expected_s)

    async def admit(self, decode: WorkerInfo, req: RouteRequest, mode: str,
                    prefill_worker: str | None, expected_prefill_s: float = 0.0) -> AdmitReply | None:
        msg = AdmitRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                           mode=mode, prefill_worker=prefill_worker, generated_token_ids=req.generated_token_ids,
                           attempt=req.attempt, expected_prefill_s=expected_prefill_s)
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
        bus, state = await connect(stack, settings, "router")
        await Router(settings, bus, state, tracer).serve(stop)
    tracing.shutdown()


def main(settings: RouterSettings | None = None) -> None:
    """The router with `settings` (`pdserve router`: its flags), else from the environment."""
    settings = settings or RouterSettings()
    setup_logging(settings, "router")
    run(serve(settings))


if __name__ == "__main__":
    main()
