"""Prefill worker: runs prompts, publishes each first token, hands the KV to a decode worker.

1. Start: load the model, build the engine, open the UCX transport, make sure the prefill
   work queue exists, register in Redis with a heartbeat lease, pull from this worker's
   durable consumer (`pd.prefill.jobs.<id>`).
2. Take jobs (up to `max_jobs` in flight); a job cancelled before it starts is dropped.
3. Step the engine: queued prompts are prefilled together, long ones in chunks. A prompt
   that completes yields its first token, published at once on `pd.tokens.<rid>` (seq 0),
   so time to first token never waits for the decode side.
4. Hand off: export the KV blocks the decode worker lacks, announce them with a KVHeader on
   `pd.decode.<id>.kv` (fingerprint, layout, checksums, first token), send the layers over
   UCX, wait for the ack (the lease: `kv_ack_timeout_s`), then free the blocks, ack the job.
   A request that finished on its first token releases the decode side's reservation.
5. Cancel: abort the request wherever it is.
6. SIGTERM: leave the registry, stop pulling jobs, finish the ones taken, drain NATS.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
from nats.aio.msg import Msg
from opentelemetry import trace

from shared import subjects
from shared.bus import Bus, context_of
from shared.config import PrefillSettings
from shared.engine.engine import Engine, RequestOutput
from shared.engine_host import EngineHost
from shared.kv import KVTransport, checksum
from shared.engine.sequence import Status
from shared.messages import FINISHED_IN_PREFILL, Cancel, KVAck, KVHeader, PrefillJob, TokenChunk
from shared.service import heartbeat, run, setup_logging
from shared.worker import serve_worker, worker_id, worker_info
from shared.state import State

log = logging.getLogger("prefill")


class PrefillWorker:
    def __init__(self, settings: PrefillSettings, engine: Engine, bus: Bus, state: State,
                 transport: KVTransport, tracer: trace.Tracer):
        self.settings, self.engine, self.bus, self.state = settings, engine, bus, state
        self.transport, self.tracer = transport, tracer
        self.id = worker_id(settings, "prefill")
        self.host = EngineHost(engine)
        self.jobs: dict[str, tuple[PrefillJob, Msg, trace.Span]] = {}
        self.cancelled: set[str] = set()
        self.handoffs: set[asyncio.Task] = set()

    def info(self):
        return worker_info(self.engine, self.id, "prefill", self.settings)

    async def serve(self, stop: asyncio.Event) -> None:
        await self.bus.ensure_prefill_stream()
        pull = await self.bus.js.pull_subscribe(subjects.prefill_jobs(self.id), durable=self.id)
        await self.bus.subscribe(subjects.CANCEL_ALL, self.on_cancel)
        beat = asyncio.create_task(heartbeat(self.state, self.info, self.settings.heartbeat_s, stop))

        async def leave_registry():  # on stop, at once: the router sends no more jobs here
            await stop.wait()
            await beat
            await self.state.deregister(self.id)

        leaving = asyncio.create_task(leave_registry())
        log.info("prefill worker %s ready", self.id)
        while not stop.is_set() or self.jobs or self.handoffs:
            if not stop.is_set() and len(self.jobs) < self.settings.max_jobs:
                await self.take_jobs(pull, wait_s=0.005 if self.jobs else 0.5)
            if self.engine.has_work():
                for out in await self.host.call(self.engine.step):
                    await self.on_first_token(out)
            elif self.handoffs:
                await asyncio.wait(self.handoffs, timeout=0.05)
        await leaving
        self.host.close()

    async def take_jobs(self, pull, wait_s: float) -> None:
        try:
            msgs = await pull.fetch(self.settings.max_jobs - len(self.jobs), timeout=wait_s)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):  # no job waiting
            return
        for msg in msgs:
            job = PrefillJob.decode(msg.data)
            if job.request_id in self.cancelled or job.request_id in self.jobs:
                await msg.ack()  # cancelled before it started, or a redelivery of a job in hand
                continue
            ctx = context_of(msg)
            queued = msg.metadata.timestamp.timestamp() if msg.metadata.timestamp else time.time()
            self.tracer.start_span("prefill.queue", context=ctx, start_time=int(queued * 1e9)).end()
            span = self.tracer.start_span("prefill.compute", context=ctx, attributes={
                "request_id": job.request_id, "prompt_tokens": len(job.prompt_token_ids), "worker": self.id})
            try:
                await self.host.call(self.engine.add_request, job.request_id, job.prompt_token_ids,
                                     job.sampling.to_engine(), prefill_only=True)
            except ValueError as e:  # the router validated it; a mismatch here is a bug, not a retry
                span.record_exception(e)
                span.end()
                await msg.term()
                continue
            self.jobs[job.request_id] = (job, msg, span)

    async def on_first_token(self, out: RequestOutput) -> None:
        job, msg, span = self.jobs[out.request_id]
        span.set_attribute("cached_tokens", out.num_cached_tokens)
        span.end()
        await self.bus.publish(subjects.tokens(out.request_id), TokenChunk.from_output(out), ctx=trace.set_span_in_context(span))
        if out.finished:  # done on its first token: nothing to hand off
            del self.jobs[out.request_id]
            await self.bus.publish(subjects.cancel(out.request_id),
                                   Cancel(request_id=out.request_id, reason=FINISHED_IN_PREFILL))
            await msg.ack()
            return
        task = asyncio.create_task(self.handoff(job, msg, out, trace.set_span_in_context(span)))
        self.handoffs.add(task)
        task.add_done_callback(self.handoffs.discard)

    async def handoff(self, job: PrefillJob, msg: Msg, out: RequestOutput, ctx) -> None:
        rid = job.request_id
        with self.tracer.start_as_current_span("kv.transfer", context=ctx) as span:
            try:
                export = await self.host.call(self.engine.export_kv, rid, job.first_block)
                layers = [(await self.host.call(export.layer_bytes, i)).numpy() for i in range(export.num_layers)]
                header = KVHeader(request_id=rid, fingerprint=export.fingerprint, first_block=job.first_block,
                                  num_blocks=export.num_blocks, num_layers=export.num_layers,
                                  layer_nbytes=layers[0].nbytes if layers else 0,
                                  checksums=[checksum(p) for p in layers], first_token=out.new_token_ids[0])
                ack_sub = await self.bus.nc.subscribe(subjects.kv_ack(rid), max_msgs=1)
                start = time.perf_counter()
                await self.bus.publish(subjects.decode_kv(job.decode_worker), header)
                sending = asyncio.create_task(self.transport.send(job.decode_address, job.kv_tag, layers))
                try:
                    # the ack comes after the import, or early as a refusal (the decode side's
                    # deadline passed, or it was cancelled): then stop sending what no one receives
                    ack = KVAck.decode((await ack_sub.next_msg(timeout=self.settings.kv_ack_timeout_s)).data)
                finally:
                    if not sending.done():
                        sending.cancel()
                        await self.transport.forget(job.decode_address)
                span.set_attribute("acked", ack.ok)
                if ack.ok:
                    sent = sending.result()
                    elapsed = time.perf_counter() - start
                    span.set_attributes({"request_id": rid, "bytes": sent, "blocks": export.num_blocks,
                                         "layers": export.num_layers, "transport": self.transport.name,
                                         "gbps": sent / max(elapsed, 1e-9) / 1e9, "skipped_blocks": job.first_block})
                else:
                    log.warning("%s: decode side refused the KV: %s", rid, ack.error)
            except Exception as e:  # the decode side falls back to a local prefill on its deadline
                log.warning("%s: KV handoff failed: %s", rid, e)
                span.record_exception(e)
            finally:
                await self.host.call(self.engine.free, rid)
                self.jobs.pop(rid, None)
                await msg.ack()

    async def on_cancel(self, msg: Msg) -> None:
        cancel = Cancel.decode(msg.data)
        if cancel.reason == FINISHED_IN_PREFILL:
            return
        self.cancelled.add(cancel.request_id)
        if len(self.cancelled) > 10_000:
            self.cancelled.clear()
        seq = self.engine.seqs.get(cancel.request_id)
        if cancel.request_id in self.jobs and seq is not None and seq.status is Status.WAITING:
            # still prefilling; once parked, the handoff owns the job and the decode side's
            # refusal (or the lease) ends it
            await self.host.call(self.engine.abort, cancel.request_id)
            job, jmsg, span = self.jobs.pop(cancel.request_id)
            span.add_event("cancelled")
            span.end()
            await jmsg.ack()


def main() -> None:
    settings = PrefillSettings()
    setup_logging(settings.log_level, "prefill")
    run(serve_worker("prefill", settings, PrefillWorker))


if __name__ == "__main__":
    main()
