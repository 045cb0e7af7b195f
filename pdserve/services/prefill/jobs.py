"""What a prefill worker holds of each job it took: one record per request, from its prompt
queued on the engine to the job's ack (handed off, refused, cancelled, or finished on its
first token). The event loop alone reads and writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from pdserve.shared.bus import Bus
from pdserve.shared.messages import PrefillJob


@dataclass(eq=False)
class Job:
    job: PrefillJob
    msg: Msg                         # its delivery, acked once the job is over
    compute_span: trace.Span | None  # `prefill.compute` while its prompt is computed; then its handoff owns it
    kv_span: trace.Span | None       # `kv.transfer`, until its handoff ends
    computed_at: float = 0.0         # when its last layer was computed (monotonic; 0: not yet)

    @property
    def computing(self) -> bool:
        return self.compute_span is not None

    def end_kv(self, acked: bool, error: str = "", **attributes: AttributeValue) -> None:
        """Its `kv.transfer` span ends (once)."""
        span, self.kv_span = self.kv_span, None
        if span is not None:
            span.set_attributes({"acked": acked, "error": error, **attributes})
            span.end()


class Jobs:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus  # (a job's ack is a publish)
        self.records: dict[str, Job] = {}

    def open(self, job: PrefillJob, msg: Msg, compute_span: trace.Span, kv_span: trace.Span) -> None:
        self.records[job.request_id] = Job(job, msg, compute_span, kv_span)

    def get(self, rid: str) -> Job | None:
        return self.records.get(rid)

    async def ack(self, record: Job) -> None:
        """The job is over (handed off, refused or cancelled): dropped, and its delivery acked (it
        leaves the queue) unless it was dropped before. An ack the bus loses lets JetStream
        deliver the job again after its ack_wait: a prefill spent, which its decode worker answers
        with the ack it gave."""
        if self.records.get(record.job.request_id) is record:
            del self.records[record.job.request_id]
            await self.bus.tried("job_ack", record.msg.ack())

    def computing(self) -> int:
        """Jobs whose prompt is being computed (the handoffs under way not counted)."""
        return sum(j.computing for j in self.records.values())

    def all(self) -> list[Job]:
        return list(self.records.values())
