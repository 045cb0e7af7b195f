"""Decode worker: receives a request's KV, generates its tokens in a continuous batch.

1. Start: load the model, build the engine, open the UCX transport, register in Redis with a
   heartbeat lease (free blocks, running sequences, UCX address) — only once all of that
   works — and subscribe to `pd.decode.<id>.admit` and `pd.decode.<id>.cancel`.
2. Admit (router → here): mode "remote" reserves the prompt's blocks (reusing this worker's
   prefix cache), replies with the first block to send and a UCX tag, puts the prefill job
   on the chosen prefill worker's queue (JetStream), then waits for the KV; mode "local"
   queues the whole prompt here (colocated, or the fallback). No room →
   refuse, so the router tries another worker before any prefill work is spent. A repeated
   admit of a request gets the first reply again. Each admit is its own task (a burst, such as
   a failover's, is answered in one engine step, not one step each).
3. KV arrives layer by layer while the prefill runs (pdserve/shared/kv/receiver.py): a KVLayer notice
   on `pd.decode.<id>.kv` (NATS), then its payload over UCX, received only once the notice is
   here; fingerprint, layout and every block's checksum are checked before the blocks are
   written into the reservation (a corrupt block is asked for again; after a reconnect of the
   bus, waiting receivers ask for lost notices with KVSync). KVEnd brings the first
   token; once every block of every layer is in, the sequence joins the batch and the prefill
   worker gets its ack (`pd.prefill.<p>.kv.ack`) and frees its copy. A prefill worker gone or
   frozen meanwhile → its job moves to another prefill worker for the same reservation
   (pdserve/services/decode/handoff.py). KV refused or still bad, or no other prefill worker → drop
   the reservation, mark the request `prefill_local` in Redis, and prefill locally (no gap
   for the client: chunks carry sequence numbers, the gateway drops duplicates); the prefill
   worker gets KVAck(not ok) and stops computing it. A request a router will not place again
   (it crashed two workers: pdserve/shared/quarantine.py) ends with an error chunk.
4. Loop: the engine steps ahead of the event loop (pdserve/shared/engine_ahead.py; each pass's
   requests recorded before it runs: pdserve/shared/batches.py); while the next step computes,
   publish each output of a step as a TokenChunk on `pd.tokens.<rid>`, and keep
   it (pdserve/services/decode/chunk_log.py): a gateway that lost chunks on the bus (a NATS restart)
   asks for them again on `pd.decode.<id>.replay` instead of moving the request.
5. Cancel (`pd.decode.<id>.cancel`, sent only to the workers of the request's placements):
   abort the request wherever it is; its blocks return to the pool.
6. SIGTERM: mark the registry entry draining (the router sends nothing more), refuse new
   admits, finish the sequences it has (those still receiving their KV included), then leave
   the registry and drain NATS.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from nats.aio.msg import Msg
from opentelemetry import trace

from pdserve.services.decode.admits import AdmitReplies
from pdserve.services.decode.chunk_log import ChunkLog
from pdserve.services.decode.handoff import Handoffs, Quarantined
from pdserve.services.decode.requests import DecodeRequest, DecodeRequests
from pdserve.services.decode.watch import PrefillWorkerLate, PrefillWorkerLost
from pdserve.shared import macs, metrics, subjects, tracing
from pdserve.shared.bus import Bus, after_reconnects, context_of
from pdserve.shared.config import DecodeSettings
from pdserve.shared.engine.block_manager import OutOfBlocks
from pdserve.shared.engine.engine import Engine, RequestOutput
from pdserve.shared.engine.kv_io import Reservation
from pdserve.shared.engine.sequence import SamplingParams
from pdserve.shared.kv import KVTransport
from pdserve.shared.kv.receiver import KVCancelled, KVReceiver
from pdserve.shared.kv.same_host import SameHost
from pdserve.shared.messages import (
    AdmitReply,
    AdmitRequest,
    Cancel,
    KVAck,
    Replay,
    ReplayReply,
    TokenChunk,
    WorkerInfo,
)
from pdserve.shared.service import heartbeat, run, serving, setup_logging, until_stopped
from pdserve.shared.state import State
from pdserve.shared.tasks import Background
from pdserve.shared.worker import WorkerCore, serve_worker

log = logging.getLogger("decode")


class DecodeWorker:
    def __init__(self, settings: DecodeSettings, engine: Engine, bus: Bus, state: State,
                 transport: KVTransport, tracer: trace.Tracer):
        self.core = WorkerCore("decode", settings, engine, state, transport, bus)
        self.settings, self.engine, self.bus, self.state = settings, engine, bus, state
        # KV from a prefill worker on this host is read out of that worker's segment (or pool, both on CUDA)
        self.transport = SameHost.reader(transport, settings.kv_segment_scope, engine.runner.device)
        self.id, self.host, self.tracer = self.core.id, self.core.host, tracer
        self.requests = DecodeRequests()  # one record per request placed here
        self.handoffs = Handoffs(self.id, settings, engine, bus, state, self.transport)
        self.inbox = self.handoffs.inbox
        self.replies = AdmitReplies()  # by (request, attempt): a repeated admit gets the first reply
        self.advanced: set[str] = set()  # requests with a token since the last heartbeat (their deadlines
        # move on; a request that finished meanwhile too, so not in its record)
        self.chunks = ChunkLog()            # what was published, for gateways that lost some
        self.queueing = Background(log, "prefill job")  # jobs being put on prefill workers' queues
        self.admits = Background(log, "admit")          # admits and cancels under way (each its own task)

    def info(self) -> WorkerInfo:
        return self.core.info()

    async def serve(self, stop: asyncio.Event) -> None:
        await self.bus.subscribe(subjects.decode_admit(self.id), self.start_admit)
        await self.inbox.start()
        await self.core.start_prefix()
        for subject in subjects.decode_control(self.id).values():   # the gateway's and the supervisor's
            await self.bus.subscribe(subject, self.on_cancel)
        await self.bus.subscribe(subjects.decode_replay(self.id), self.on_replay)
        # registered (as draining, after SIGTERM) until the last sequence is done: the gateway
        # tells a draining worker from a dead one, and does not move its streams
        gone, engine_stop = asyncio.Event(), asyncio.Event()
        beat = asyncio.create_task(heartbeat(self.state, self.info, self.settings.heartbeat_s, gone))
        engine_loop = asyncio.create_task(self.host.run(self.publish, engine_stop, overlap=True))
        deadlines = asyncio.create_task(self.keep_deadlines())
        resync = asyncio.create_task(after_reconnects(self.bus, self.settings.heartbeat_s, self.inbox.sync))
        watch = asyncio.create_task(self.handoffs.watch.watch(self.handoffs.waited_on))
        log.info("decode worker %s ready: %d KV blocks", self.id, self.engine.num_blocks)
        serving()
        await until_stopped(stop, {"engine loop": engine_loop, "heartbeat": beat, "deadlines": deadlines,
                                   "resync": resync, "handoff watch": watch}, self.state, self.id)
        await self.core.drain()  # no new admits
        await asyncio.gather(*self.admits, return_exceptions=True)  # those in flight are answered
        if receiving := self.requests.receiving():  # KV still on its way: those sequences join the batch
            await asyncio.wait(receiving, timeout=self.settings.kv_timeout_s + 5)  # and finish too
        engine_stop.set()
        await engine_loop  # after engine_stop it returns once the running sequences are done
        for task in self.requests.receiving():
            task.cancel()
        gone.set()
        deadlines.cancel()
        resync.cancel()
        watch.cancel()
        await beat
        await self.core.leave()
        await self.core.close_prefix()
        self.host.close()

    # -- admission ---------------------------------------------------------------------------
    async def start_admit(self, msg: Msg) -> None:
        """Each admit in its own task: its reservation waits for the engine thread, and admits
        handled one after another would each wait out an engine step (a failover's burst of
        admits then took seconds to answer)."""
        self.admits.start(self.on_admit(msg))

    async def on_admit(self, msg: Msg) -> None:
        req = AdmitRequest.decode(msg.data)
        parent = context_of(msg)
        with tracing.continued(self.tracer, "decode.admit", parent) as span:
            span.set_attributes({"request_id": req.request_id, "mode": req.mode, "worker": self.id})
            key = (req.request_id, req.attempt)
            repeat = self.replies.seen(key)
            reply = await self.replies.answer(key, lambda: self.reserve(req))  # idempotent (admits.py)
            rx = self.inbox.receivers.get(req.request_id)
            if reply.ok and req.mode == "remote" and rx is not None and not repeat:
                self.queueing.start(self.handoffs.queue_prefill(req, rx, parent))
            span.set_attributes({"ok": reply.ok, "reason": reply.reason, "first_block": reply.first_block})
            record = self.requests.get(req.request_id)
            if reply.ok and record is not None and record.attempt == req.attempt:
                record.span = self.tracer.start_span("decode.generate", context=parent, attributes={
                    "request_id": req.request_id, "attempt": req.attempt, "mode": req.mode, "worker": self.id})
            await self.bus.respond(msg, reply)

    async def reserve(self, req: AdmitRequest) -> AdmitReply:
        rid, params = req.request_id, req.sampling.to_engine()
        if self.core.draining:
            return AdmitReply(request_id=rid, ok=False, reason="draining")
        try:
            if req.mode == "local":
                await self.prefill_locally(req, "resumed" if req.generated_token_ids else "placed")
                return AdmitReply(request_id=rid, ok=True, reason="local prefill")
            res, record = await self.host.call(self.reserve_on_engine, req, params)
        except OutOfBlocks as e:
            return AdmitReply(request_id=rid, ok=False, reason=f"no room: {e}")
        except ValueError as e:
            return AdmitReply(request_id=rid, ok=False, reason=str(e))
        rx = self.handoffs.receiver(res, req.prefill_worker or "", req.secret)
        record.receiving = asyncio.create_task(self.receive_kv(req, record))
        return AdmitReply(request_id=rid, ok=True, first_block=res.first_block, num_blocks=res.num_blocks,
                          kv_tag=rx.kv_tag)

    def reserve_on_engine(self, req: AdmitRequest, params: SamplingParams) -> tuple[Reservation, DecodeRequest]:
        """On the engine thread, in order with cancels (abort_older): blocks for the KV of the
        prompt and, after a failover, of the tokens generated before it. A request placed
        before (attempt > 0: moved off a lost or stalled worker) may take a place beyond
        max_num_seqs (`failover_seqs`): its client is mid-stream, a new request can wait."""
        limit = self.engine.cfg.max_num_seqs + (self.settings.failover_seqs if req.attempt else 0)
        res = self.engine.reserve(req.request_id, req.prompt_token_ids, params, req.generated_token_ids, limit)
        return res, self.requests.open(req.request_id, req.attempt, req.secret, req.crashes)

    async def prefill_locally(self, req: AdmitRequest, why: str) -> None:
        """The whole prompt runs here: placed here (colocated mode, a short prompt), a failover
        placed here with no prefill worker to take it (`resumed`: prompt + the tokens another
        decode worker generated before it was lost), or the `fallback` from a failed handoff."""
        metrics.DECODE_PREFILLS.labels(why).inc()
        def add() -> None:  # on the engine thread, in order with cancels (abort_older)
            self.engine.add_request(req.request_id, req.prompt_token_ids, req.sampling.to_engine(),
                                    generated_token_ids=req.generated_token_ids, crashes=req.crashes)
            self.requests.open(req.request_id, req.attempt, req.secret, req.crashes).prefilled_here = True
        await self.host.call(add)
        self.host.wake.set()

    # -- KV arrival --------------------------------------------------------------------------
    async def receive_kv(self, req: AdmitRequest, record: DecodeRequest) -> None:
        rid, rx = req.request_id, self.inbox.receivers[req.request_id]
        parent = trace.set_span_in_context(record.span) if record.span is not None else None
        with self.tracer.start_as_current_span("kv.receive", context=parent) as span:
            try:
                expected_s, left = req.expected_prefill_s, []  # prefill workers this request's job left
                while True:
                    try:
                        first_token = await self.handoffs.wait_kv(rx, expected_s)
                        break
                    except (PrefillWorkerLost, PrefillWorkerLate) as e:  # the job follows to another one
                        left.append(rx.prefill_worker)
                        rx, expected_s = await self.handoffs.requeue(req, rx, e, left, span, record)
                end = rx.end
                assert end is not None  # (wait_kv returned: KVEnd(ok) is in)
                out = await self.host.call(self.engine.commit_import, rid, first_token, end.first_logprob,
                                           end.prompt_logprobs, record.crashes)
                if not out.finished:  # published by the prefill side; kept here (before any later
                    # token) for a gateway that lost it
                    chunk = TokenChunk.from_output(out, req.attempt, self.id)
                    self.chunks.record(chunk, macs.sign(chunk, req.secret))
                await self.handoffs.ack(rx, KVAck(request_id=rid, ok=True))
                await self.handoffs.report(rx, ok=True)
                span.set_attribute("ok", True)
                metrics.KV_RECEIVED.inc(rx.bytes_received)
                if out.finished:
                    out.text = ""  # the prefill side published the first token's text
                    await self.publish([out])
                self.host.wake.set()
            except asyncio.CancelledError:
                # cancelled (or this worker stops): the prefill side frees its copy now, not when
                # its lease runs out
                await self.handoffs.ack(rx, KVAck(request_id=rid, ok=False, error="cancelled"))
                raise
            except Exception as e:  # noqa: BLE001 - late, corrupt, refused or mismatched KV: never decode from it
                span.set_attributes({"ok": False, "error": str(e) or type(e).__name__})
                rx.close()
                await self.handoff_failed(req, rx, e, record)
            finally:
                rx.close()
                span.set_attributes({"bytes": rx.bytes_received, "pieces": rx.pieces, "bad_blocks": rx.bad_blocks,
                                     "resends": rx.resends, "blocks": int(rx.have.shape[1])})
                if record.receiving is asyncio.current_task():  # (not cancelled already)
                    record.receiving = None
                if self.inbox.receivers.get(rid) is rx:
                    del self.inbox.receivers[rid]

    async def handoff_failed(self, req: AdmitRequest, rx: KVReceiver, e: Exception, record: DecodeRequest) -> None:
        """The prefill side is told; this placement's reservation is dropped (only this one: a
        cancel may have let a newer one in meanwhile) and, unless the placement is over (it was
        cancelled), the prompt is prefilled here under the same record."""
        rid, reason = req.request_id, str(e) or type(e).__name__
        await self.handoffs.ack(rx, KVAck(request_id=rid, ok=False, error=reason))
        ended, _ = await self.host.call(self.abort_older, rid, req.attempt + 1)
        if not ended or isinstance(e, (KVCancelled, Quarantined)):
            log.info("%s: KV handoff of attempt %d ended (%s); its placement is over", rid, req.attempt, reason)
            if ended and isinstance(e, Quarantined):  # its client reads why (a 422), nothing runs it again
                chunk = TokenChunk(request_id=rid, seq=len(req.generated_token_ids), token_ids=[], text="",
                                   finished=True, finish_reason="error", error=reason, quarantined=True,
                                   attempt=req.attempt, worker=self.id)
                await self.bus.tried("tokens", self.bus.publish_signed(subjects.tokens(rid),
                                                                       macs.sign(chunk, record.secret)))
            self.requests.close(rid, record)
            return
        record.first_token = None
        log.warning("%s: KV handoff failed (%s); prefilling locally", rid, reason)
        await self.prefill_locally(req.model_copy(update={"crashes": record.crashes}), "fallback")
        if not isinstance(e, (PrefillWorkerLost, PrefillWorkerLate)):  # the path's fault
            await self.handoffs.report(rx, ok=False, reason=reason)
        # a prefill worker that gets this job later (it was down, or queued deep) drops it
        # (Redis away: that worker would only waste a prefill)
        self.state.requests.note(rid, "prefill_local", by=self.id, attempt=req.attempt,
                                 prompt_tokens=len(req.prompt_token_ids), reason=reason)

    async def keep_deadlines(self) -> None:
        """Each heartbeat, push on the deadlines of the requests that advanced here (one call
        for all): a request that stops getting tokens becomes overdue for the supervisor."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            advanced, self.advanced = list(self.advanced), set()
            try:
                await self.state.requests.progressed(advanced, self.settings.stall_s)
            except Exception as e:  # noqa: BLE001 - Redis away: the next round tries again
                log.debug("deadlines not moved: %s", e)

    # -- output and cancellation -----------------------------------------------------------
    def publish(self, outputs: list[RequestOutput]) -> Awaitable[None]:
        """Each output as a TokenChunk on `pd.tokens.<rid>`, signed for the placement that made it: its record taken
        now, on the engine thread as the step ends (engine_ahead.py), in order with admits and cancels; the chunks
        go out on the loop while the next steps compute (which may end the request, or place it here anew)."""
        return self._publish([(out, self.requests.get(out.request_id)) for out in outputs])

    async def _publish(self, outputs: list[tuple[RequestOutput, DecodeRequest | None]]) -> None:
        for out, record in outputs:
            if record is None or record.closed:  # cancelled since its step: no placement to sign it for
                continue
            rid = out.request_id
            chunk = TokenChunk.from_output(out, record.attempt, self.id)
            signed = macs.sign(chunk, record.secret)
            self.chunks.record(chunk, signed)  # (the bus away: kept there for the gateway's replay)
            await self.bus.tried("tokens", self.bus.publish_signed(subjects.tokens(rid), signed))
            if record.closed:  # cancelled while it was published
                continue
            self.advanced.add(rid)
            if out.finished:
                self.finished(out, record)
            elif record.first_token is None:  # (an abort's output, finished, is no first token)
                self.first_token(out, record)

    def first_token(self, out: RequestOutput, record: DecodeRequest) -> None:
        """The first token this worker made for a request: it is decoding here."""
        record.decoding(out.num_generated_tokens)
        if record.span is not None:
            record.span.add_event("first_token", {"generated_before": out.num_generated_tokens - 1})
        if record.prefilled_here:  # local mode, a fallback, a failover with no prefill worker
            metrics.PROMPT_TOKENS.labels("decode").inc(out.num_prompt_tokens)
            metrics.CACHED_TOKENS.labels("decode").inc(out.num_cached_tokens)
        self.state.requests.note(out.request_id, "decoding", by=self.id, attempt=record.attempt,
                                 prompt_tokens=out.num_prompt_tokens)

    def finished(self, out: RequestOutput, record: DecodeRequest) -> None:
        """A request ended here (its last chunk published): its span closes with its pace."""
        if self.requests.close(out.request_id, record) and (span := record.span) is not None:
            span.set_attributes({"output_tokens": out.num_generated_tokens,
                                 "finish_reason": out.finish_reason or ""})
            if (pace := record.time_per_output_token_ms(out.num_generated_tokens)) is not None:
                span.set_attribute("time_per_output_token_ms", pace)
            span.end()

    async def on_cancel(self, msg: Msg) -> None:
        """A cancel counts with the MAC of the placement here (the gateway's, or the prefill
        worker's when the request finished there), or on the subject only routers publish to."""
        cancel = Cancel.decode(msg.data)
        rid, record = cancel.request_id, self.requests.get(cancel.request_id)
        if msg.subject != subjects.decode_supervisor_cancel(self.id) and \
                (record is None or not macs.signed_with(record.secret, msg)):
            return
        task = record.receiving if record is not None else None  # a KV wait, unless of a placement the cancel spares
        if record is not None and task is not None and (cancel.before_attempt is None
                                                      or record.attempt < cancel.before_attempt):
            record.receiving = None
            task.cancel()  # it answers the prefill side as it ends
            self.inbox.close(rid)
        else:
            task = None
        if task is not None or rid in self.engine.seqs:  # (a task: the next cancel does not wait for the step)
            self.admits.start(self.abort(rid, cancel.before_attempt))

    async def abort(self, rid: str, before_attempt: int | None) -> None:
        """Checked and done on the engine thread, in order with admits: a failover's cancel
        never stops the placement it was sent for, whichever handler runs first."""
        ended, record = await self.host.call(self.abort_older, rid, before_attempt)
        if ended:
            self.chunks.forget(rid)
            if record is not None and self.requests.close(rid, record) and record.span is not None:
                record.span.add_event("cancelled")
                record.span.end()

    async def on_replay(self, msg: Msg) -> None:
        req = Replay.decode(msg.data)
        chunks = self.chunks.since(req.request_id, req.from_seq, placed=req.request_id in self.engine.seqs)
        if chunks is None:
            await self.bus.respond(msg, ReplayReply(request_id=req.request_id, ok=False,
                                                    reason=f"no chunks from {req.from_seq} here"))
            return
        for signed in chunks:
            await self.bus.publish_signed(subjects.tokens(req.request_id), signed)
        metrics.REPLAYED_CHUNKS.inc(len(chunks))
        await self.bus.respond(msg, ReplayReply(request_id=req.request_id, ok=True, chunks=len(chunks)))

    def abort_older(self, rid: str, before_attempt: int | None) -> tuple[bool, DecodeRequest | None]:
        """On the engine thread: abort the request unless it is a placement at or after
        `before_attempt` (None: whatever it is). Whether it did, and the request's record here."""
        record = self.requests.get(rid)
        if before_attempt is not None and (record.attempt if record is not None else 0) >= before_attempt:
            return False, record
        self.engine.abort(rid)
        return True, record


def main(settings: DecodeSettings | None = None) -> None:
    """The decode worker with `settings` (`pdserve decode`: its flags), else from the environment."""
    settings = settings or DecodeSettings()
    setup_logging(settings, "decode")
    run(serve_worker("decode", settings, DecodeWorker))


if __name__ == "__main__":
    main()
