"""The decode side of a KV handoff: what pdserve/services/decode/main.py's step 3 is made of.

1. A reservation gets a receiver under a tag range of its own (`receiver`), and its prompt's
   job goes on the chosen prefill worker's queue (`queue_prefill`, JetStream).
2. The wait (`wait_kv`) ends with the first token once every block is in. Meanwhile the
   prefill workers waited on are looked at once per heartbeat for all the waits, in one
   round trip (watch.py): one gone (its lease lapsed and no connection to the bus, for
   `absent_s`: killed), or a payload from it broken off in the transport (it died
   mid-transfer: UCX fails the receive at once) → PrefillWorkerLost; one whose engine step
   has run far past the prefill's predicted time and its own slowest recent step with no KV
   coming (frozen), or no KV for `kv_timeout_s` → PrefillWorkerLate.
3. Either → `requeue`: a router names another prefill worker (`pd.router.requeue`), the one
   left is told to stop (KVAck not ok), and the job goes on the new one's queue for the same
   reservation under a new tag range. No other prefill worker → the error stands: the
   caller prefills the prompt itself.
4. The prefill worker hears how it ended (`ack`: it frees its copy, or stops computing), the
   routers' breakers how the path did (`report`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import nats.errors
from opentelemetry import context, trace

from pdserve.services.decode.requests import DecodeRequest
from pdserve.services.decode.watch import PrefillWatch, PrefillWorkerLate, PrefillWorkerLost
from pdserve.shared import metrics, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.config import DecodeSettings
from pdserve.shared.engine.engine import Engine
from pdserve.shared.engine.kv_io import Reservation
from pdserve.shared.kv import TAG_SPAN, KVTransport
from pdserve.shared.kv.receiver import KVBrokeOff, KVInbox, KVReceiver
from pdserve.shared.lifecycle import kv_deadline_s
from pdserve.shared.messages import AdmitRequest, KVAck, KVOutcome, PrefillJob, Requeue, Requeued
from pdserve.shared.state import State

log = logging.getLogger("decode.handoff")



class Quarantined(RuntimeError):
    """The request crashed workers (pdserve/shared/quarantine.py): a router placed it no more."""

class Handoffs:
    """One decode worker's KV handoffs: receivers (in `inbox`), queued jobs, waits, requeues."""

    def __init__(self, worker_id: str, settings: DecodeSettings, engine: Engine, bus: Bus, state: State,
                 transport: KVTransport):
        self.id, self.settings, self.engine, self.bus, self.transport = worker_id, settings, engine, bus, transport
        self.inbox = KVInbox(bus, worker_id)
        self.watch = PrefillWatch(state.registry, settings.heartbeat_s, settings.absent_s, self.off_bus)

    @property
    def host(self) -> str:
        """This worker's host identity for PrefillJob.decode_host: prefill workers on this host
        then place KV in their segments for it (pdserve/shared/kv/segment.py); "" when it reads none."""
        return self.transport.host if self.settings.kv_segment_bytes else ""

    @property
    def device(self) -> str:
        """Its pool's kind for PrefillJob.decode_device where it reads a prefill worker's pool in place
        (pdserve/shared/engine/kv_device.py); "": never."""
        return self.transport.device if self.host else ""

    async def off_bus(self, worker: str) -> bool:
        """No connection of `worker` on the bus: the server says no responders to a Ping on its
        KVSync subject (a live worker subscribes to it)."""
        return await self.bus.heard(subjects.prefill_kv_sync(worker), min(0.25, self.settings.heartbeat_s)) is False

    def waited_on(self) -> set[str]:
        return {rx.prefill_worker for rx in list(self.inbox.receivers.values()) if rx.prefill_worker}

    def receiver(self, res: Reservation, prefill_worker: str, secret: str) -> KVReceiver:
        """What receives a reservation's KV from `prefill_worker`, under a tag range of its own."""
        kv_tag = random.getrandbits(63 - TAG_SPAN.bit_length()) * TAG_SPAN  # the sender numbers within
        return self.inbox.add(KVReceiver.for_engine(self.engine, res, kv_tag, self.transport, self.bus, prefill_worker,
                                                    self.settings.kv_max_sends, secret))

    async def queue_prefill(self, req: AdmitRequest, rx: KVReceiver, ctx: context.Context | None,
                            requeued: bool = False) -> None:
        """The prompt's job on the queue of the receiver's prefill worker, made here, where the
        reservation is: the router neither encodes the prompt again nor waits for the stream,
        and a job that cannot be queued turns into a local prefill now rather than at the KV
        deadline. Its trace parent is the router's placement, like the admit's."""
        job = PrefillJob(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                         decode_worker=self.id, decode_address=self.transport.address,
                         decode_fingerprint=self.engine.fingerprint, first_block=rx.res.first_block,
                         kv_tag=rx.kv_tag, generated_token_ids=req.generated_token_ids, attempt=req.attempt,
                         requeued=requeued, decode_host=self.host, decode_device=self.device, secret=req.secret,
                         crashes=req.crashes)
        try:
            await self.bus.queue_prefill(rx.prefill_worker, job, ctx)
        except Exception as e:  # noqa: BLE001 - NATS or the stream away: prefill here
            log.warning("%s: prefill job not queued (%s); prefilling locally", req.request_id, e)
            rx.fail(f"prefill job not queued: {e}")

    async def wait_kv(self, rx: KVReceiver, expected_prefill_s: float) -> int:
        """The first token, once every block is in. Raises PrefillWorkerLost when the watch
        finds the prefill worker gone or a payload from it broke off in the transport;
        PrefillWorkerLate when its engine step has run longer than lifecycle.kv_deadline_s of
        the prefill's predicted time and `kv_timeout_factor` x its slowest recent step (frozen:
        a busy machine's steps are slow, not hung), or no KV came for `kv_timeout_s` (far
        behind). Each KV piece received starts the waiting over."""
        s, worker = self.settings, rx.prefill_worker
        frozen_s = kv_deadline_s(expected_prefill_s, s.kv_timeout_factor, s.kv_min_timeout_s, s.kv_timeout_s)
        waiting = asyncio.ensure_future(rx.wait())
        since, pieces = time.monotonic(), rx.pieces
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=s.heartbeat_s / 4)  # the watch's verdicts: a dict
                if done:
                    try:
                        return waiting.result()
                    except KVBrokeOff as e:  # its sender most likely died mid-transfer: the job moves
                        raise PrefillWorkerLost(str(e)) from e
                now = time.monotonic()
                if rx.pieces != pieces:  # progress
                    since, pieces = now, rx.pieces
                if now - since >= s.kv_timeout_s:
                    raise PrefillWorkerLate(f"no KV from {worker or 'the prefill worker'} for {s.kv_timeout_s:g} s "
                                            f"(deadline passed)")
                if worker in self.watch.gone:
                    raise PrefillWorkerLost(f"prefill worker {worker} is gone")
                entry = self.watch.entries.get(worker)
                if entry is None:  # not looked at yet, or missing and not yet confirmed
                    continue
                hung_s = max(frozen_s, s.kv_timeout_factor * entry.slowest_step_s)  # its steps are that slow now
                if entry.step_s >= hung_s and now - since >= hung_s:
                    raise PrefillWorkerLate(f"prefill worker {worker}'s engine step has run {entry.step_s:.1f} s "
                                            f"with no KV (frozen: its recent steps took up to "
                                            f"{entry.slowest_step_s:.1f} s; the prefill was predicted to take "
                                            f"{expected_prefill_s:.1f} s)")
        finally:
            waiting.cancel()

    async def requeue(self, req: AdmitRequest, rx: KVReceiver, why: PrefillWorkerLost | PrefillWorkerLate,
                      left: list[str], span: trace.Span, record: DecodeRequest) -> tuple[KVReceiver, float]:
        """The prefill worker computing this request's KV is gone or late: a router picks
        another one (`Requeue`; none of those the job `left`), which computes the prompt for
        the same reservation under a new tag range (what the one left sent, if anything, is
        overwritten; a notice from it now is refused, and a late one is told to stop). Returns
        the new receiver and the new prediction; raises `why` when no other prefill worker
        takes it: prefilled here then. The crashes the router charged it go on `record` (and in
        the new job): its next passes, there and here, run alone."""
        kind = "gone" if isinstance(why, PrefillWorkerLost) else "late"
        span.add_event(f"prefill worker {kind}", {"prefill_worker": rx.prefill_worker, "reason": str(why)})
        broke_off = isinstance(why.__cause__, KVBrokeOff) and rx.prefill_worker not in self.watch.gone
        if kind == "late" or broke_off:  # the path's fault, as far as the breakers know (a live
            await self.report(rx, ok=False, reason=str(why))  # pair whose transfers fail trips one)
        ask = Requeue(request_id=req.request_id, model=self.settings.model_name, prompt_token_ids=req.prompt_token_ids,
                      decode_worker=self.id, avoid_workers=left, why=kind,
                      generated_token_ids=req.generated_token_ids, attempt=req.attempt,
                      cache_salt=req.sampling.cache_salt)
        try:
            answer = await self.bus.request(subjects.REQUEUE, ask, Requeued, timeout=self.settings.heartbeat_s * 2)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            raise why from e
        if answer.quarantined:
            raise Quarantined(answer.reason)
        record.crashes = max(record.crashes, answer.crashes)
        if not answer.prefill_worker:
            raise type(why)(f"{why}; {answer.reason}")
        log.info("%s: prefill worker %s is %s; its job goes to %s", req.request_id, rx.prefill_worker, kind,
                 answer.prefill_worker)
        rx.close()
        await self.ack(rx, KVAck(request_id=req.request_id, ok=False, error=f"moved to {answer.prefill_worker}: {why}"))
        moved = self.receiver(rx.res, answer.prefill_worker, rx.secret)
        await self.queue_prefill(req.model_copy(update={"crashes": record.crashes}), moved, None, requeued=True)
        metrics.REQUEUED_JOBS.inc()
        return moved, answer.expected_prefill_s

    async def ack(self, rx: KVReceiver, ack: KVAck) -> None:
        """To the prefill worker computing the request's KV: it may free its copy (not ok: it
        stops computing the prompt too)."""
        if rx.prefill_worker:
            await self.inbox.ack(rx.prefill_worker, ack.model_copy(update={"kv_tag": rx.kv_tag}), rx.secret)

    async def report(self, rx: KVReceiver, ok: bool, reason: str = "") -> None:
        """How the handoff over this prefill → decode path went, for the routers' breakers."""
        outcome = KVOutcome(request_id=rx.rid, ok=ok, reason=reason, prefill_worker=rx.prefill_worker,
                            decode_worker=self.id)
        await self.bus.tried("kv_outcome", self.bus.publish(subjects.KV_OUTCOMES, outcome))
