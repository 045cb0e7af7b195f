"""Router: decides where each request runs, admits it on a decode worker, dispatches prefill.

1. Start: make sure the prefill work queue exists; join the `router` queue group on
   `pd.router.route` (several replicas share the requests).
2. Route (gateway → here): read the live workers from the registry (leases: a dead worker
   is simply absent), decide local or remote prefill (policy.py), pick the decode worker.
3. Admit on the decode worker first (it reserves KV blocks, or refuses and the next
   candidate is asked), so no prefill is spent on a request that has nowhere to decode.
4. Remote: put the prefill job on the chosen prefill worker's queue (JetStream, kept until
   the worker acks it after the KV handoff). Record the request's state in Redis.
5. Reply to the gateway with the placement and its reason (also on the `router.route` span).
6. SIGTERM: leave the queue group, finish the routes in flight, drain NATS.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import AsyncExitStack

import nats.errors
from nats.aio.msg import Msg
from opentelemetry import trace

from shared import subjects, tracing
from shared.bus import Bus, context_of
from shared.config import RouterSettings
from shared.messages import AdmitReply, AdmitRequest, PrefillJob, RouteReply, RouteRequest, WorkerInfo
from shared.service import connect, heartbeat, run, setup_logging, stop_event
from shared.state import State
from services.router import policy

log = logging.getLogger("router")
BLOCK_SIZE = 16
WORKERS_TTL_S = 0.2


class Router:
    def __init__(self, settings: RouterSettings, bus: Bus, state: State, tracer: trace.Tracer):
        self.settings, self.bus, self.state, self.tracer = settings, bus, state, tracer
        self._workers: tuple[float, list[WorkerInfo]] = (0.0, [])
        self._background: set[asyncio.Task] = set()

    async def workers(self) -> list[WorkerInfo]:
        """The live registry, re-read at most every WORKERS_TTL_S (heartbeats are 1 s apart;
        a stale entry costs one refused admit, which moves on to the next candidate)."""
        fetched_at, workers = self._workers
        now = time.monotonic()
        if now - fetched_at > WORKERS_TTL_S:
            workers = [w for w in await self.state.workers() if w.role != "router"]
            self._workers = (now, workers)
        return workers

    def in_background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def serve(self, stop: asyncio.Event) -> None:
        await self.bus.ensure_prefill_stream()
        sub = await self.bus.subscribe(subjects.ROUTE, self.on_route, queue=subjects.ROUTER_QUEUE)
        me = WorkerInfo(worker_id=f"router-{uuid.uuid4().hex[:8]}", role="router")
        beat = asyncio.create_task(heartbeat(self.state, lambda: me, self.settings.heartbeat_s, stop))
        log.info("router ready")
        await stop.wait()
        await beat
        await self.state.deregister(me.worker_id)
        await sub.drain()

    async def on_route(self, msg: Msg) -> None:
        req = RouteRequest.decode(msg.data)
        with self.tracer.start_as_current_span("router.route", context=context_of(msg)) as span:
            span.set_attributes({"request_id": req.request_id, "prompt_tokens": len(req.prompt_token_ids)})
            try:
                reply = await self.route(req)
            except Exception as e:  # Redis or NATS trouble: refuse clearly rather than hang the client
                log.exception("%s: routing failed", req.request_id)
                reply = RouteReply(request_id=req.request_id, ok=False, reason=f"routing failed: {e}")
            span.set_attributes({"ok": reply.ok, "mode": reply.mode or "", "reason": reply.reason,
                                 "decode_worker": reply.decode_worker or "",
                                 "prefill_worker": reply.prefill_worker or ""})
            await self.bus.respond(msg, reply)

    async def route(self, req: RouteRequest) -> RouteReply:
        rid = req.request_id
        workers = [w for w in await self.workers() if w.model == req.model]
        prefills = [w for w in workers if w.role == "prefill"]
        blocks = -(-(len(req.prompt_token_ids) + 1) // BLOCK_SIZE)
        for decode in policy.decode_candidates([w for w in workers if w.role == "decode"], blocks):
            prefill = policy.choose_prefill(prefills, decode.fingerprint)
            mode, reason = policy.prefill_mode(len(req.prompt_token_ids), int(prefill is not None),
                                               self.settings.local_prefill_below)
            admit = await self.admit(decode, req, mode, prefill)
            if admit is None or not admit.ok:
                continue
            if mode == "remote":
                job = PrefillJob(request_id=rid, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                                 decode_worker=decode.worker_id, decode_address=decode.ucx_address,
                                 decode_fingerprint=decode.fingerprint,
                                 first_block=admit.first_block, kv_tag=admit.kv_tag)
                # not awaited: the reply need not wait for the queue's ack; if the job is lost,
                # the decode worker's KV deadline turns the request into a local prefill
                self.in_background(self.dispatch(prefill.worker_id, job))
            self.in_background(self.state.record(rid, "routed", mode=mode, reason=reason, decode=decode.worker_id,
                                                 prefill=prefill.worker_id if mode == "remote" else ""))
            return RouteReply(request_id=rid, ok=True, mode=mode, reason=reason, decode_worker=decode.worker_id,
                              prefill_worker=prefill.worker_id if mode == "remote" else None)
        reason = "no decode worker is up" if not any(w.role == "decode" for w in workers) else \
            "no decode worker has room for this request now"
        return RouteReply(request_id=rid, ok=False, reason=reason)

    async def dispatch(self, prefill_worker: str, job: PrefillJob) -> None:
        try:
            await self.bus.js.publish(subjects.prefill_jobs(prefill_worker), job.encode(), headers=tracing.inject())
        except Exception as e:
            log.warning("%s: prefill job not queued (%s); the decode worker will prefill it", job.request_id, e)

    async def admit(self, decode: WorkerInfo, req: RouteRequest, mode: str,
                    prefill: WorkerInfo | None) -> AdmitReply | None:
        msg = AdmitRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                           mode=mode, prefill_worker=prefill.worker_id if prefill else None)
        try:
            return await self.bus.request(subjects.decode_admit(decode.worker_id), msg, AdmitReply,
                                          timeout=self.settings.admit_timeout_s)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            log.warning("%s: decode worker %s did not answer the admit", req.request_id, decode.worker_id)
            return None


async def serve(settings: RouterSettings) -> None:
    tracer = tracing.setup("router", settings.otlp_endpoint)
    async with AsyncExitStack() as stack:
        stop = stop_event()
        bus, state = await connect(stack, settings, "router")
        await Router(settings, bus, state, tracer).serve(stop)
    tracing.shutdown()


def main() -> None:
    settings = RouterSettings()
    setup_logging(settings.log_level, "router")
    run(serve(settings))


if __name__ == "__main__":
    main()
