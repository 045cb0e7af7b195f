"""The workers holding a request — the decode and prefill workers of each of its placements —
and its cancel, sent to them alone (`pd.decode.<w>.cancel`, `pd.prefill.<w>.cancel`): what a
request costs the bus does not grow with the fleet.

Every placement counts, not only the latest: a failover's cancel must still reach a worker
that missed an earlier one (a NATS restart loses core messages), and a decode worker checks
`Cancel.before_attempt` itself, so a newer placement there is never stopped by it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.shared import subjects
from pdserve.shared.bus import Bus
from pdserve.shared.lifecycle import Event
from pdserve.shared.messages import Cancel


@dataclass
class Holders:
    decode: dict[str, set[str]] = field(default_factory=dict)    # worker -> the secrets of its placements here
    prefill: dict[str, set[str]] = field(default_factory=dict)

    def add(self, decode: str | None = None, prefill: str | None = None, secret: str = "") -> None:
        """Workers of a placement (and its secret, when known: the gateway's)."""
        for held, worker in ((self.decode, decode), (self.prefill, prefill)):
            if worker:
                held.setdefault(worker, set()).update({secret} if secret else set())

    @classmethod
    def of(cls, events: Iterable[Event]) -> Holders:
        """From a request's events: each `routed` names its placement's workers, and the workers'
        own events name them too (should a `routed` note have been lost). No secrets: the
        supervisor's view."""
        h = cls()
        for e in events:
            f = e.fields
            if e.event == "routed":
                h.add(f.get("decode"), f.get("prefill"))
            elif e.event in ("prefilling", "transferring"):
                h.add(f.get("decode"), e.by)
            elif e.event in ("prefill_local", "decoding"):
                h.add(decode=e.by)
        return h

    async def cancel(self, bus: Bus, msg: Cancel) -> None:
        """The gateway's cancel: to each worker once per placement's secret it holds, signed
        with it (a worker takes a cancel only with the MAC of a placement it holds)."""
        for held, subject in ((self.decode, subjects.decode_cancel), (self.prefill, subjects.prefill_cancel)):
            for worker in sorted(held):
                for secret in sorted(held[worker]) or [""]:   # ("": none known, unsigned)
                    await bus.publish(subject(worker), msg, secret=secret)

    async def cancel_as_supervisor(self, bus: Bus, msg: Cancel) -> None:
        """A router's supervisor's cancel, on the subjects only routers publish to (no MAC)."""
        for held, subject in ((self.decode, subjects.decode_supervisor_cancel),
                              (self.prefill, subjects.prefill_supervisor_cancel)):
            for worker in sorted(held):
                await bus.publish(subject(worker), msg)
