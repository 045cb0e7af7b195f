"""Dead letters, in every router replica (one takes each, queue group `router`): a prefill job
JetStream delivered JOB_MAX_DELIVERIES times to its worker without an ack (pdserve/shared/streams.py:
the worker died with it each time, or froze) is delivered no more, and the server says so on
its max-deliveries advisory, with the job's stream sequence.

1. Read the job by its sequence (a work queue keeps it until PREFILL_MAX_AGE_S).
2. Publish it on `pd.prefill.dead` (DeadJob) for the operator, count it, log it.
3. A request still waiting on that job (its latest placement's prefill there, before its KV
   came) is moved as a stalled one: a `Stalled` word to its gateway, which places it again.
   A request that crashes every worker it reaches ends by the crash count (quarantine.py).
"""

from __future__ import annotations

import logging

import nats.errors
from nats.aio.msg import Msg
from pydantic import BaseModel, ConfigDict

from pdserve.shared import lifecycle, metrics, quarantine, subjects
from pdserve.shared.bus import Bus
from pdserve.shared.messages import DeadJob, PrefillJob, Stalled
from pdserve.shared.state import State

log = logging.getLogger("router.dead_letters")


class MaxDeliveries(BaseModel):
    """The server's advisory (io.nats.jetstream.advisory.v1.max_deliver), the fields read."""

    model_config = ConfigDict(extra="ignore")
    stream: str
    consumer: str
    stream_seq: int
    deliveries: int


class DeadLetters:
    def __init__(self, bus: Bus, state: State, router_id: str):
        self.bus, self.state, self.id = bus, state, router_id

    async def start(self) -> None:
        await self.bus.subscribe(subjects.JOB_MAX_DELIVERIES, self.on_advisory, queue=subjects.ROUTER_QUEUE)

    async def on_advisory(self, msg: Msg) -> None:
        note = MaxDeliveries.model_validate_json(msg.data)
        raw, job = await self.read(note.stream_seq)
        dead = DeadJob(request_id=job.request_id if job else "", prefill_worker=note.consumer,
                       stream_seq=note.stream_seq, deliveries=note.deliveries, job=raw)
        await self.bus.tried("dead_job", self.bus.publish(subjects.PREFILL_DEAD, dead))
        metrics.DEAD_JOBS.inc()
        log.error("%s: prefill job %d delivered %d times to %s without an ack: on %s", dead.request_id or "?",
                  note.stream_seq, note.deliveries, note.consumer, subjects.PREFILL_DEAD)
        if job is not None:
            await self.move(job, note.consumer)

    async def read(self, seq: int) -> tuple[str, PrefillJob | None]:
        """The job at `seq` as queued, but its placement's secret, and decoded ("", None: gone from
        the stream, unreadable)."""
        try:
            raw = (await self.bus.js.get_msg(subjects.PREFILL_STREAM, seq)).data or b""
        except nats.errors.Error as e:
            log.warning("dead prefill job %d not read: %s", seq, e)
            return "", None
        try:
            job = PrefillJob.decode(raw)
        except ValueError:
            return raw.decode(errors="replace"), None
        return job.model_copy(update={"secret": ""}).encode().decode(), job

    async def move(self, job: PrefillJob, prefill_worker: str) -> None:
        """Its request moved on if it still waits on this job (Redis away: no verdict, the
        supervisor finds it overdue)."""
        rid = job.request_id
        try:
            s = lifecycle.summarize(await self.state.requests.events(rid))
        except Exception as e:  # noqa: BLE001
            log.warning("%s: events not read (%s)", rid, e)
            return
        if quarantine.waits_on(s, prefill_worker, job.attempt):
            await self.bus.publish(subjects.stalled(rid), Stalled(request_id=rid, attempt=s.attempt, phase=s.phase,
                                                                 worker=s.decode))
            self.state.requests.note(rid, "stalled", by=self.id, attempt=s.attempt, in_phase=s.phase,
                                     worker=prefill_worker)
