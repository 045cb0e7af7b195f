"""A router's circuit breakers, one per prefill → decode KV path (policy.Breaker). Every replica
hears how each KV handoff ended (`pd.kv.outcomes`, `record`); a path that keeps failing is
blocked for a cooldown (a placement skips it: placement.Books.blocked), then probed by the
next request sent that way (`chosen`)."""

from __future__ import annotations

import logging

from services.router import policy
from shared.messages import KVOutcome

log = logging.getLogger("router")


class Breakers:
    def __init__(self, failures: int, window_s: float, cooldown_s: float):
        self.failures, self.window_s, self.cooldown_s = failures, window_s, cooldown_s
        self.paths: dict[tuple[str, str], policy.Breaker] = {}  # (prefill, decode) KV paths
        self.tripped: dict[str, set[str]] = {}  # decode worker -> prefill workers whose path's breaker is not closed

    def path(self, prefill: str, decode: str) -> policy.Breaker:
        key = (prefill, decode)
        if key not in self.paths:
            self.paths[key] = policy.Breaker(self.failures, self.window_s, self.cooldown_s)
        return self.paths[key]

    def record(self, out: KVOutcome, now: float) -> None:
        b = self.path(out.prefill_worker, out.decode_worker)
        before = b.state
        b.record(out.ok, now)
        tripped = self.tripped.setdefault(out.decode_worker, set())
        if b.opened_at is None:
            tripped.discard(out.prefill_worker)
        else:
            tripped.add(out.prefill_worker)
        if b.state != before:
            log.warning("KV path %s -> %s: breaker %s (%s)", out.prefill_worker, out.decode_worker, b.state,
                        out.reason or "ok")

    def blocked(self, decode: str, now: float) -> set[str]:
        """The prefill workers whose path to `decode` a new request may not take now (only the
        paths not closed need asking)."""
        return {p for p in self.tripped.get(decode, ()) if not self.path(p, decode).allow(now)}

    def chosen(self, prefill: str, decode: str, now: float) -> None:
        self.path(prefill, decode).chosen(now)
