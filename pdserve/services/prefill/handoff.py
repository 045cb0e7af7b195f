"""The prefill side of a KV handoff once its prompt is computed: what pdserve/services/prefill/main.py's
step 4 is made of (the layers themselves stream during the passes: pdserve/shared/kv/sender.py).

1. The first token (`first_tokens`, the engine loop's callback): published at once on
   `pd.tokens.<rid>` (seq 0, signed with the placement's secret). A request that finished on it
   releases its decode worker's reservation (a Cancel) and its job is acked: nothing to hand off.
2. The lease (`lease`): KVEnd with the first token; the blocks stay until the decode side
   acks, gives up, or `kv_ack_timeout_s` passes (re-sends answered meanwhile); then the job is
   acked (before the free: a later attempt's job waits for it) and the blocks freed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan

from pdserve.services.prefill.jobs import Job, Jobs
from pdserve.shared import macs, metrics, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.config import PrefillSettings
from pdserve.shared.engine.engine import RequestOutput
from pdserve.shared.engine_host import EngineHost
from pdserve.shared.kv.sender import KVSender
from pdserve.shared.messages import FINISHED_IN_PREFILL, Cancel, TokenChunk
from pdserve.shared.state import State

log = logging.getLogger("prefill")


class Handoffs:
    def __init__(self, worker_id: str, settings: PrefillSettings, bus: Bus, state: State, host: EngineHost,
                 sender: KVSender, jobs: Jobs):
        self.id, self.settings, self.bus, self.state, self.host = worker_id, settings, bus, state, host
        self.sender, self.jobs = sender, jobs
        self.leases: set[asyncio.Task] = set()  # handoffs waiting for the decode side's answer

    async def first_tokens(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            await self.first_token(out)

    async def first_token(self, out: RequestOutput) -> None:
        record = self.jobs.get(out.request_id)
        if record is None or record.compute_span is None:  # cancelled while its last pass ran
            return
        job, span = record.job, record.compute_span
        record.compute_span = None  # from here the handoff (or nothing) owns it
        metrics.PROMPT_TOKENS.labels("prefill").inc(out.num_prompt_tokens)
        metrics.CACHED_TOKENS.labels("prefill").inc(out.num_cached_tokens)
        span.set_attribute("cached_tokens", out.num_cached_tokens)
        span.end()
        if isinstance(span, ReadableSpan) and span.start_time and span.end_time:
            metrics.PREFILL_SECONDS.observe((span.end_time - span.start_time) / 1e9)
        signed = macs.sign(TokenChunk.from_output(out, job.attempt, self.id), job.secret)
        # (the bus away: the decode worker keeps the first token in its chunk log for the gateway's replay; one
        # that finished here is lost with its cancel, and the gateway moves the request)
        await self.bus.tried("tokens", self.bus.publish_signed(subjects.tokens(out.request_id), signed,
                                                               ctx=trace.set_span_in_context(span)))
        if out.finished:  # done on its first token: nothing to hand off
            self.sender.drop(out.request_id)
            record.end_kv(acked=False, error="finished in prefill")
            cancel = Cancel(request_id=out.request_id, reason=FINISHED_IN_PREFILL)
            await self.bus.tried("cancel", self.bus.publish(subjects.decode_cancel(job.decode_worker), cancel,
                                                            secret=job.secret))
            await self.jobs.ack(record)
            return
        self.state.requests.note(out.request_id, "transferring", by=self.id, attempt=job.attempt,
                                 prompt_tokens=len(job.prompt_token_ids) + len(job.generated_token_ids),
                                 decode=job.decode_worker)
        record.computed_at = time.monotonic()
        task = asyncio.create_task(self.lease(record, out))
        self.leases.add(task)
        task.add_done_callback(self.leases.discard)

    async def lease(self, record: Job, first: RequestOutput) -> None:
        """The blocks stay until the decode side answers (or time runs out)."""
        job, rid = record.job, record.job.request_id
        h = self.sender.handoffs[rid]
        acked = False
        try:
            ack = await self.sender.finish(rid, first.new_token_ids[0], self.settings.kv_ack_timeout_s,
                                           first.logprobs[0] if first.logprobs else None, first.prompt_logprobs)
            acked = ack.ok
            if not ack.ok:
                log.warning("%s: KV handoff ended without the decode side's ack: %s", rid, ack.error)
            exposed_s = time.monotonic() - record.computed_at
            record.end_kv(acked=ack.ok, error=ack.error, bytes=h.bytes_sent, segment_bytes=h.segment_bytes,
                          device_bytes=h.device_bytes, pieces=h.pieces, resent_blocks=h.resent_blocks,
                          skipped_blocks=job.first_block,
                          exposed_ms=round(1e3 * exposed_s, 3))  # last layer computed -> decode side's ack
        except Exception as e:  # noqa: BLE001 - the decode side falls back to a local prefill on its deadline
            log.warning("%s: KV handoff failed: %s", rid, e)
            record.end_kv(acked=False, error=str(e))
        finally:
            metrics.KV_BYTES.labels(self.sender.transport.name).inc(h.bytes_sent - h.segment_bytes - h.device_bytes)
            metrics.KV_BYTES.labels("segment").inc(h.segment_bytes)
            metrics.KV_BYTES.labels("device").inc(h.device_bytes)
            metrics.KV_RESENT.inc(h.resent_blocks)
            metrics.KV_SECONDS.observe(time.monotonic() - record.computed_at)
            if not acked:
                metrics.KV_FAILURES.inc()
            await self.jobs.ack(record)  # before the free: a later attempt's job waits for the free
            await self.host.call(self.host.engine.free, rid)
