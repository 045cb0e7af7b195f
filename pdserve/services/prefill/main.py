"""Prefill worker: runs prompts, publishes each first token, streams the KV to a decode worker.

1. Start: load the model, build the engine, open the UCX transport, make sure the prefill
   work queue exists, register in Redis with a heartbeat lease (queued tokens, measured
   prefill rate), pull from this worker's durable consumer (`pd.prefill.jobs.<id>`; a job delivered
   JOB_MAX_DELIVERIES times unacked goes to the dead letters). Each engine pass's requests are
   recorded before it runs (pdserve/shared/batches.py: a crash names them). Each
   step's prefix-cache changes go to its event stream for the routers' index
   (pdserve/shared/prefix_events.py; PD_PREFIX_INDEX=redis: its slot in Redis, pdserve/shared/prefix_index.py).
2. Take jobs (a task of its own, `max_jobs` computing at once: the engine orders what it holds
   by priority — a job moved off another prefill worker, or of a request moved off a decode
   worker, ahead of new prompts — and length, so it takes deep; JetStream keeps the rest in
   order of arrival); a job cancelled before it starts is dropped. Each job opens a KV handoff
   to its decode worker (pdserve/shared/kv/sender.py; refused at once if the decode worker's
   fingerprint differs) and is queued with the engine streaming its KV. Jobs in hand are kept
   from redelivery (`in_progress` every JOB_KEEPALIVE_S) until they are acked.
3. Step the engine (its loop, a task: pdserve/shared/engine_host.py): queued prompts are prefilled
   together, long ones in chunks. As each layer of each pass is computed, its new blocks go to
   the decode worker (KVLayer notice on NATS, payload over UCX), overlapping the rest of the
   pass. A prompt that completes yields its first token, published at once (seq 0).
4. Hand off (handoff.py): KVEnd with the first token; the blocks stay until the decode side
   acks (the lease: `kv_ack_timeout_s`), re-sending any block it reports corrupt (acks and
   re-send requests come on `pd.prefill.<id>.kv.ack` / `.kv.resend`; after a reconnect of
   either side's bus, open handoffs are published again: `.kv.sync`); then free, ack the job.
   A request that finished on its first token releases its decode worker's reservation (a
   Cancel on `pd.decode.<d>.cancel`). Every heartbeat one look at the registry (and the bus,
   for one missing there: watch.py) finds the jobs whose decode worker is gone: they are given
   up (compute and lease) at once.
5. Cancel (`pd.prefill.<id>.cancel`, sent only to the workers of the request's placements),
   or the decode side gives the handoff up (a KVAck not ok before the end: its deadline, a
   cancel there, a refusal): abort the request wherever it is; a handoff in progress ends with
   KVEnd(not ok).
6. SIGTERM: mark the registry entry draining (the router sends nothing more), stop pulling
   jobs, compute and hand off the ones taken, delete its durable consumer (pdserve/shared/streams.py:
   `job_consumer`), then leave the registry and drain NATS. Killed
   instead: the lease lapses and the decode workers waiting for this worker's KV ask a router
   for another prefill worker (`pd.router.requeue`) and put the job on its queue; with none,
   they prefill it themselves. A job left on this worker's queue whose request moved on is dropped if this
   worker comes back (`taken_over`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry import trace

from pdserve.services.prefill.cancels import Cancels
from pdserve.services.prefill.handoff import Handoffs
from pdserve.services.prefill.intake import JobIntake, queued_at
from pdserve.services.prefill.jobs import Jobs
from pdserve.services.prefill.watch import DecodeWatch
from pdserve.shared import macs, metrics, streams, subjects
from pdserve.shared.bus import Bus, after_reconnects, context_of
from pdserve.shared.config import PrefillSettings
from pdserve.shared.engine import kv_device
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.kv_io import KVPiece
from pdserve.shared.engine.sequence import Status
from pdserve.shared.kv import KVTransport
from pdserve.shared.kv.same_host import SameHost
from pdserve.shared.kv.segment import make_segment
from pdserve.shared.kv.sender import KVSender, SenderSettings, WorkerHooks
from pdserve.shared.messages import (
    CANCELLED,
    FINISHED_IN_PREFILL,
    Cancel,
    PrefillJob,
    WorkerInfo,
)
from pdserve.shared.service import heartbeat, run, serving, setup_logging, until_stopped
from pdserve.shared.state import PREFILLED_ELSEWHERE, State
from pdserve.shared.tasks import Background
from pdserve.shared.worker import WorkerCore, serve_worker

log = logging.getLogger("prefill")
JOB_KEEPALIVE_S = 10.0  # JetStream redelivers a job unacked for its ack_wait (streams.JOB_ACK_WAIT_S, 30 s)
# A job delivered for the first time and younger than this starts without asking Redis whether
# its request moved on (prefilled by its decode worker, or requeued on another prefill worker):
# a decode worker gives up on a live prefill worker after PD_KV_MIN_TIMEOUT_S (5 s) at the
# soonest, and one that gave up refuses the KV and tells this worker to stop (only compute is
# lost). Saves a round trip on every first token; redeliveries and old jobs are still checked.
FRESH_JOB_S = 5.0
FETCH_WAIT_S = 0.5      # a fetch of jobs waits this long for one to come
TAKE_AGAIN_S = 0.005    # no room for another job: look again after this


class PrefillWorker:
    def __init__(self, settings: PrefillSettings, engine: Engine, bus: Bus, state: State,
                 transport: KVTransport, tracer: trace.Tracer):
        self.core = WorkerCore("prefill", settings, engine, state, transport, bus)
        self.settings, self.engine, self.bus, self.state = settings, engine, bus, state
        self.id, self.host, self.tracer = self.core.id, self.core.host, tracer
        # KV to a decode worker on this host goes into this worker's segment (when it has one and it fits)
        segment = make_segment(settings.kv_segment_bytes, self.id, settings.kv_segment_scope)
        # and to one whose pool is on a device too, it stays in this worker's pool, read from there
        self.transport = SameHost(transport, segment, pool=kv_device.share_on_device(engine.runner.kv))
        self.jobs = Jobs(bus)  # one record per job taken, until its ack
        self.sender = KVSender(SenderSettings.for_prefill(settings, self.id, engine.fingerprint), self.transport, bus,
                               WorkerHooks(self.read_blocks, self.given_up))
        self.cancels = Cancels()  # kept for the jobs taken later (cancels.py)
        self.handoffs = Handoffs(self.id, settings, bus, state, self.host, self.sender, self.jobs)
        self.ending, self.intake = Background(log, "cancel"), JobIntake()  # (ending: work being ended, on the engine)

    def info(self) -> WorkerInfo:
        return self.core.info()

    async def serve(self, stop: asyncio.Event) -> None:
        await self.bus.wait_stream(subjects.PREFILL_STREAM)  # (its consumer: its subject's, pdserve/shared/grants.py)
        await self.bus.js.add_consumer(subjects.PREFILL_STREAM, streams.job_consumer(self.id))  # made, or set anew
        pull = await self.bus.js.pull_subscribe_bind(self.id, stream=subjects.PREFILL_STREAM)
        for name in ("cancel", "supervisor_cancel"):
            await self.bus.subscribe(subjects.prefill_control(self.id)[name], self.on_cancel)
        await self.sender.start()
        await self.core.start_prefix()
        # the lease lasts until the jobs in hand are done: decode workers waiting for their KV
        # tell a draining worker (still registered, `draining`) from a dead one (gone)
        gone, engine_stop = asyncio.Event(), asyncio.Event()
        beat = asyncio.create_task(heartbeat(self.state, self.info, self.settings.heartbeat_s, gone))
        engine_loop = asyncio.create_task(self.host.run(self.handoffs.first_tokens, engine_stop))
        intake = asyncio.create_task(self.take_jobs(pull, stop))
        keepalive = asyncio.create_task(self.keep_jobs())
        watch = asyncio.create_task(self.watch_decode_workers())
        resync = asyncio.create_task(after_reconnects(self.bus, self.settings.heartbeat_s, self.sender.resync))
        log.info("prefill worker %s ready", self.id)
        serving()
        await until_stopped(stop, {"engine loop": engine_loop, "heartbeat": beat, "job intake": intake,
                                   "job keepalive": keepalive, "decode worker watch": watch, "resync": resync},
                            self.state, self.id)
        await self.core.drain()  # the router sends no more jobs here
        await intake  # (it returns once `stop` is set)
        try:  # a pull subscription left to the connection's drain holds it for the whole drain timeout
            await pull.unsubscribe()
        except Exception as e:  # noqa: BLE001 - NATS away: closing anyway
            log.debug("pull subscription: %s", e)
        engine_stop.set()
        await engine_loop  # after engine_stop it returns once the prompts taken are computed
        while self.handoffs.leases:  # and handed off
            await asyncio.wait(self.handoffs.leases)
        try:  # its jobs are done: its durable goes (jobs queued since stay in the stream, for its next life)
            await self.bus.js.delete_consumer(subjects.PREFILL_STREAM, self.id)
        except Exception as e:  # noqa: BLE001 - NATS away: the server removes it once idle (inactive_threshold)
            log.warning("job consumer not deleted: %s", e)
        keepalive.cancel()
        watch.cancel()
        resync.cancel()
        gone.set()
        await beat
        await self.core.leave()
        await self.core.close_prefix()
        self.host.close()

    async def keep_jobs(self) -> None:
        while True:
            await asyncio.sleep(JOB_KEEPALIVE_S)
            for record in self.jobs.all():
                try:
                    await record.msg.in_progress()
                except Exception as e:  # noqa: BLE001 - NATS reconnecting: the next round tries again
                    log.debug("in_progress: %s", e)

    async def watch_decode_workers(self) -> None:
        """Every heartbeat, one look at the decode workers of the jobs in hand
        (pdserve/services/prefill/watch.py): a job whose decode worker is gone is given up — its
        compute stops and its blocks are freed now, not at the end of the KV lease: nothing
        would take its KV."""
        watch = DecodeWatch(self.state.registry, self.settings.absent_s, self.off_bus)
        giving_up: set[tuple[str, int]] = set()  # jobs being given up (request, attempt)

        async def give_up(job: PrefillJob) -> None:
            try:
                await self.given_up(job, f"decode worker {job.decode_worker} is gone")
            finally:
                giving_up.discard((job.request_id, job.attempt))

        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            jobs = [h.job for h in self.sender.handoffs.values()]
            gone = await watch.look({job.decode_worker for job in jobs})
            for job in jobs:  # together: each waits for the engine thread (once: it may take longer than a round)
                if job.decode_worker in gone and (job.request_id, job.attempt) not in giving_up:
                    giving_up.add((job.request_id, job.attempt))
                    self.ending.start(give_up(job))

    async def off_bus(self, decode_worker: str) -> bool:
        """No connection of `decode_worker` on the bus: the server says no responders to a Ping
        on its replay subject."""
        return await self.bus.heard(subjects.decode_replay(decode_worker), min(0.25, self.settings.heartbeat_s)) \
            is False

    async def taken_over(self, rid: str) -> bool:
        """The decode side gave up waiting and prefilled it, or its job went to another prefill
        worker while this one was away (Redis unreachable: assume not)."""
        try:
            record = await self.state.requests.summary(rid)
            return any(f"t_{phase}" in record for phase in PREFILLED_ELSEWHERE) or \
                record.get("prefill", self.id) != self.id
        except Exception as e:  # noqa: BLE001
            log.warning("%s: request state unreadable (%s); running the job", rid, e)
            return False

    async def take_jobs(self, pull: JetStreamContext.PullSubscription, stop: asyncio.Event) -> None:
        """Until `stop`: as many jobs as there is room for (`max_jobs` computing at once)."""
        while not stop.is_set():
            if (room := self.settings.max_jobs - self.jobs.computing()) <= 0:
                await asyncio.sleep(TAKE_AGAIN_S)
                continue
            for msg in await self.intake.fetch(pull, room, FETCH_WAIT_S):
                await self.take_job(msg)

    async def take_job(self, msg: Msg) -> None:
        """One job delivered: started, unless it is not this worker's to start (now)."""
        try:
            job = PrefillJob.decode(msg.data)
        except ValueError as e:  # (pydantic's ValidationError is one) no sender could mean it: dropped
            log.error("a prefill job that does not decode, terminated: %s", e)
            await self.bus.tried("job_ack", msg.term())
            return
        if not await self.passed_over(job, msg):
            await self.start_job(job, msg)

    async def passed_over(self, job: PrefillJob, msg: Msg) -> bool:
        """Whether the job is answered without being started: acked when there is nothing to do,
        delivered again later when an older placement's work must end first."""
        fresh = msg.metadata.num_delivered == 1 and time.time() - queued_at(msg) < FRESH_JOB_S
        record = self.sender.handoffs.get(job.request_id)
        if (self.cancels.stops(job) or (record and record.job.attempt >= job.attempt)
                or (not fresh and not job.attempt and await self.taken_over(job.request_id))):
            await self.bus.tried("job_ack", msg.ack())  # cancelled before it started, a redelivery of a job
            return True  # in hand, or the decode worker gave up waiting and prefilled it (this worker's last life?)
        if record or job.request_id in self.engine.seqs:  # an older placement's work still here (a
            await self.cancel_older(job.request_id, job.attempt)  # failover came first): end it,
            await self.bus.tried("job_ack", msg.nak(delay=0.2))  # take this job once it is gone
            return True
        return False

    async def start_job(self, job: PrefillJob, msg: Msg) -> None:
        """The job's spans and KV handoff opened, its prompt queued on the engine."""
        ctx, queued = context_of(msg), queued_at(msg)
        self.tracer.start_span("prefill.queue", context=ctx, start_time=int(queued * 1e9)).end()
        metrics.PREFILL_QUEUE_SECONDS.observe(max(0.0, time.time() - queued))
        span = self.tracer.start_span("prefill.compute", context=ctx, attributes={
            "request_id": job.request_id, "prompt_tokens": len(job.prompt_token_ids), "worker": self.id})
        kv_span = self.tracer.start_span("kv.transfer", context=ctx, attributes={
            "request_id": job.request_id, "decode_worker": job.decode_worker, "transport": self.transport.name})
        sink = await self.sender.open(job, trace.set_span_in_context(kv_span))
        record = self.sender.handoffs[job.request_id]
        kv_span.set_attributes({"new_endpoint": record.new_endpoint,  # (the segment: where the payloads fit)
                                "transport": "device" if record.device else "segment" if record.same_host
                                else self.transport.name})
        try:
            await self.host.call(self.queue, job, sink)
        except Exception as e:  # noqa: BLE001 - refused (ValueError: the router validated it, so a bug),
            # or the engine failed on it: this worker leaves (the job comes back to it when it
            # restarts) until the job has failed JOB_MAX_DELIVERIES times, then the job ends here
            if not isinstance(e, ValueError) and msg.metadata.num_delivered < streams.JOB_MAX_DELIVERIES:
                raise
            await self.sender.cancel(job.request_id, f"prefill refused the prompt: {e}")
            self.sender.drop(job.request_id)
            for s in (span, kv_span):
                s.record_exception(e)
                s.end()
            await self.bus.tried("job_ack", msg.term())
            return
        self.jobs.open(job, msg, span, kv_span)
        self.host.wake.set()
        self.state.requests.note(job.request_id, "prefilling", by=self.id, attempt=job.attempt,
                                 prompt_tokens=len(job.prompt_token_ids) + len(job.generated_token_ids))

    def queue(self, job: PrefillJob, sink: Callable[[KVPiece], None] | None) -> None:
        """On the engine thread: the prompt, streaming its KV from the decode worker's first
        missing block (not at all if the handoff was refused). A job moved here (`requeued`
        off a lost or frozen prefill worker) or of a request placed before (attempt > 0:
        moved off a lost or stalled decode worker) — its client mid-stream, or waiting since
        its first placement — goes ahead of the new prompts of its priority level."""
        params = job.sampling.to_engine()
        if job.attempt or job.requeued:
            params = replace(params, priority=params.priority - 1)
        self.engine.add_request(job.request_id, job.prompt_token_ids, params, prefill_only=True,
                                generated_token_ids=job.generated_token_ids, crashes=job.crashes)
        if sink is not None:
            self.engine.stream_kv(job.request_id, job.first_block, sink)

    async def read_blocks(self, rid: str, layer: int, first_block: int, num_blocks: int) -> torch.Tensor:
        return await self.host.call(self.engine.kv_blocks, rid, layer, first_block, num_blocks)

    async def given_up(self, job: PrefillJob, reason: str) -> None:
        """The decode side ended this job's handoff before its ack (deadline, cancel, refusal,
        moved elsewhere): its prompt is not computed any further."""
        log.info("%s: the decode side gave up the handoff (%s); stopping", job.request_id, reason)
        await self.cancel_older(job.request_id, job.attempt + 1)

    async def on_cancel(self, msg: Msg) -> None:
        """Noted at once (a job taken later is dropped); the work in hand is ended in a task of
        its own: an abort waits for the engine step under way, and cancels handled one after
        another — a decode worker's loss cancels dozens — would each wait out a step while the
        engine computes prompts nobody will take."""
        cancel = Cancel.decode(msg.data)
        if cancel.reason == FINISHED_IN_PREFILL:
            return
        rid, supervisor = cancel.request_id, msg.subject == subjects.prefill_supervisor_cancel(self.id)
        before = math.inf if cancel.before_attempt is None else cancel.before_attempt  # a failover: older ones
        self.cancels.note(rid, before, msg, supervisor)
        record = self.sender.handoffs.get(rid) or self.jobs.get(rid)   # (the placement's secret, when here)
        if supervisor or (record is not None and macs.signed_with(record.job.secret, msg)):
            self.ending.start(self.cancel_older(rid, before))

    async def cancel_older(self, rid: str, before: float) -> None:
        """End this worker's work for the request's placements before attempt `before`: a
        handoff waiting for its ack ends now (KVEnd not ok; its blocks are freed as it ends), a
        prompt still being prefilled is aborted."""
        record = self.sender.handoffs.get(rid)
        if record is not None and record.job.attempt < before:
            await self.sender.cancel(rid, CANCELLED)
        taken, seq = self.jobs.get(rid), self.engine.seqs.get(rid)
        if (taken is not None and taken.computing and taken.job.attempt < before and seq is not None
                and seq.status is Status.WAITING):
            await self.host.call(self.engine.abort, rid)
            span, taken.compute_span = taken.compute_span, None
            if span is None:  # its last pass finished meanwhile: the handoff owns it, ends on the cancel
                return
            self.sender.drop(rid)
            taken.end_kv(acked=False, error="cancelled")
            span.add_event("cancelled")
            span.end()
            await self.jobs.ack(taken)

def main(settings: PrefillSettings | None = None) -> None:
    """The prefill worker with `settings` (`pdserve prefill`: its flags), else from the environment."""
    settings = settings or PrefillSettings()
    setup_logging(settings, "prefill")
    run(serve_worker("prefill", settings, PrefillWorker))


if __name__ == "__main__":
    main()
