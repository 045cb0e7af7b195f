"""What a router sent lately, which the workers' registry entries may not show yet (recent.py:
prompt tokens per prefill worker, requests admitted per decode worker), and its round-robin
cursor; with the paths its breakers block (breakers.py), placement.Books as a placement reads them."""

from __future__ import annotations

from services.router import placement, policy
from services.router.breakers import Breakers
from services.router.placement import Books, Placement
from services.router.recent import Recent, horizons


class Bookings:
    def __init__(self, heartbeat_s: float, breakers: Breakers):
        self.breakers = breakers
        sent_s, admitted_s = horizons(heartbeat_s)
        self.sent, self.admitted = Recent(sent_s), Recent(admitted_s)
        self.turn = 0  # remote placements tried so far (round-robin baseline)

    def books(self, now: float, decode: str | None = None) -> Books:
        """The admits booked per decode worker (ranking), or for a prompt bound to `decode`: the
        prefill tokens sent, the prefill workers whose path to it is blocked now, the cursor."""
        if decode is None:
            return Books(admitted=self.admitted.totals(now))
        return Books(sent=self.sent.totals(now), blocked={decode: self.breakers.blocked(decode, now)},
                     turn=self.turn)

    def prefill(self, prefill: policy.PrefillCandidate, decode: str, prompt_tokens: int, now: float) -> list:
        """A prompt sent to `prefill` for `decode`: its uncached tokens counted on that worker's
        queue (routes decided meanwhile see them until its registry entry catches up) and the
        path's breaker told; returns the booking, to `sent.cancel` if the admit is refused."""
        self.breakers.chosen(prefill.worker_id, decode, now)
        return self.sent.add(prefill.worker_id, prompt_tokens - prefill.cached_tokens, now)

    def tried(self, chosen: Placement) -> None:
        self.turn = placement.next_turn(self.turn, chosen.prefill is not None)
