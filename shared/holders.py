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

from shared import subjects
from shared.bus import Bus
from shared.lifecycle import Event
from shared.messages import Cancel


@dataclass
class Holders:
    decode: set[str] = field(default_factory=set)
    prefill: set[str] = field(default_factory=set)

    def add(self, decode: str | None = None, prefill: str | None = None) -> None:
        if decode:
            self.decode.add(decode)
        if prefill:
            self.prefill.add(prefill)

    @classmethod
    def of(cls, events: Iterable[Event]) -> Holders:
        """From a request's events: each `routed` names its placement's workers, and the workers'
        own events name them too (should a `routed` note have been lost)."""
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
        for worker in sorted(self.decode):
            await bus.publish(subjects.decode_cancel(worker), msg)
        for worker in sorted(self.prefill):
            await bus.publish(subjects.prefill_cancel(worker), msg)
