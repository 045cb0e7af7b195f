"""The cancels a prefill worker is sent, kept for the jobs it takes later: a failover's cancel
can come before the job it stops (the job waits in the queue, or is delivered again).

A cancel counts only from whoever holds the placement: signed with the placement's secret (the
gateway's, pdserve/shared/macs.py), or sent on the subject only routers publish to (the supervisor's).
One that comes before its job is kept with its MAC and checked against the job's secret when
the job is taken; another process's cancel is never a reason to drop a job.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.msg import Msg

from pdserve.shared import macs
from pdserve.shared.messages import PrefillJob

KEPT = 10_000   # requests with cancels kept (then all are let go: a job cancelled that long ago is gone)
PER_REQUEST = 4  # cancels kept per request (a request is placed at most MAX_ATTEMPTS times)


@dataclass(frozen=True)
class Noted:
    before: float        # placements before this attempt are cancelled (inf: all)
    data: bytes          # the cancel as sent, and its MAC ("" for the supervisor's: its subject vouches)
    mac: str
    supervisor: bool


class Cancels:
    def __init__(self) -> None:
        self.noted: dict[str, list[Noted]] = {}

    def note(self, rid: str, before: float, msg: Msg, supervisor: bool) -> None:
        if len(self.noted) > KEPT:
            self.noted.clear()
        kept = self.noted.setdefault(rid, [])
        kept.append(Noted(before, msg.data, (msg.headers or {}).get(macs.HEADER, ""), supervisor))
        del kept[:-PER_REQUEST]

    def stops(self, job: PrefillJob) -> bool:
        """Whether a cancel kept for the job's request stops it: one for placements after the
        job's, from its placement's holder (signed with its secret) or the supervisor."""
        return any(job.attempt < n.before and (n.supervisor or macs.valid(job.secret, n.data, n.mac))
                   for n in self.noted.get(job.request_id, ()))
