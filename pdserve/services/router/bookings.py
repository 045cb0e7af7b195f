"""What a router sent lately, which the workers' registry entries may not show yet (recent.py:
prompt tokens per prefill worker, requests admitted per decode worker), and its round-robin
cursor; with the paths its breakers block (breakers.py), placement.Books as a placement reads them."""

from __future__ import annotations

from pdserve.services.router.breakers import Breakers
from pdserve.services.router.placement import Books, Placement, next_turn
from pdserve.services.router.recent import Recent, horizons


class Bookings:
    def __init__(self, heartbeat_s: float, breakers: Breakers):
        self.breakers = breakers
        sent_s, admitted_s = horizons(heartbeat_s)
        self.sent, self.admitted = Recent(sent_s), Recent(admitted_s)
        self.turn = 0  # remote placements tried so far (round-robin baseline)

    def books(self, now: float) -> Books:
        """The admits booked per decode worker, the prefill tokens sent per prefill worker, the
        KV paths blocked now, the cursor."""
        return Books(admitted=self.admitted.totals(now), sent=self.sent.totals(now),
                     blocked=self.breakers.blocked(now), turn=self.turn)

    def tried(self, chosen: Placement, tokens: int, now: float) -> list | None:
        """A placement asked of its decode worker: a remote one's uncached prompt tokens counted on
        its prefill worker's queue (routes decided meanwhile see them until that worker's registry
        entry catches up), the path's breaker told, the cursor moved on; returns the booking, to
        `cancel` if the admit is refused. `tokens`: what is prefilled (Ask.tokens)."""
        self.turn = next_turn(self.turn, chosen.prefill is not None)
        if chosen.prefill is None:
            return None
        return self.sent_to(chosen, tokens, now)

    def sent_to(self, chosen: Placement, tokens: int, now: float) -> list | None:
        """`tokens` to prefill sent to `chosen`'s prefill worker (a requeue: the cursor stays)."""
        prefill = chosen.prefill
        if prefill is None:
            return None
        self.breakers.chosen(prefill.worker_id, chosen.decode.worker_id, now)
        return self.sent.add(prefill.worker_id, tokens - prefill.cached_tokens, now)

    def cancel(self, booking: list | None) -> None:
        if booking is not None:
            self.sent.cancel(booking)
