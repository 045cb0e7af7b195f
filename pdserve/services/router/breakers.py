"""A router's circuit breakers, one per prefill → decode KV path (`Breaker`). Every replica
hears how each KV handoff ended (`pd.kv.outcomes`, `record`); a path that keeps failing is
blocked for a cooldown (a placement skips it: placement.Books.blocked), then probed by the
next request sent that way (`chosen`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdserve.shared.messages import KVOutcome

log = logging.getLogger("router")


@dataclass
class Breaker:
    """Circuit breaker for one prefill → decode KV path (a plain state machine; the caller
    passes the time). Closed: remote prefills go this way. `failures` failed handoffs within
    `window_s` (and no more successes than failures among them) open it: for `cooldown_s` new
    requests avoid the path — another prefill worker, or a local prefill on the decode
    worker. Then half-open: one request probes it; success closes it, failure opens it again."""

    failures: int = 5
    window_s: float = 30.0
    cooldown_s: float = 10.0
    outcomes: list[tuple[float, bool]] = field(default_factory=list)
    opened_at: float | None = None
    probing_since: float | None = None

    def record(self, ok: bool, now: float) -> None:
        self.outcomes = [(t, o) for t, o in self.outcomes if t > now - self.window_s] + [(now, ok)]
        if self.opened_at is not None:           # the probe's answer (or a straggler's)
            if ok and self.probing_since is not None:
                self.opened_at = self.probing_since = None
                self.outcomes = []
            elif not ok:
                self.opened_at, self.probing_since = now, None
            return
        bad = sum(not o for _, o in self.outcomes)
        if bad >= self.failures and bad >= len(self.outcomes) - bad:
            self.opened_at = now

    def allow(self, now: float) -> bool:
        """May a new request use the path now? Half-open: one probe at a time (`chosen`); a
        probe that never reports back frees the slot after another cooldown."""
        if self.opened_at is None:
            return True
        if now - self.opened_at < self.cooldown_s:
            return False
        return self.probing_since is None or now - self.probing_since >= self.cooldown_s

    def chosen(self, now: float) -> None:
        """A request was sent this way: when the breaker is not closed, it is the probe."""
        if self.opened_at is not None:
            self.probing_since = now

    @property
    def state(self) -> str:
        return "closed" if self.opened_at is None else ("half-open" if self.probing_since else "open")


class Breakers:
    def __init__(self, failures: int, window_s: float, cooldown_s: float):
        self.failures, self.window_s, self.cooldown_s = failures, window_s, cooldown_s
        self.paths: dict[tuple[str, str], Breaker] = {}  # (prefill, decode) KV paths
        self.tripped: dict[str, set[str]] = {}  # decode worker -> prefill workers whose path's breaker is not closed

    def path(self, prefill: str, decode: str) -> Breaker:
        key = (prefill, decode)
        if key not in self.paths:
            self.paths[key] = Breaker(self.failures, self.window_s, self.cooldown_s)
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

    def blocked(self, now: float) -> dict[str, set[str]]:
        """Per decode worker, the prefill workers whose path to it a new request may not take now
        (only the paths not closed need asking)."""
        out = {d: {p for p in ps if not self.path(p, d).allow(now)} for d, ps in self.tripped.items() if ps}
        return {d: ps for d, ps in out.items() if ps}

    def chosen(self, prefill: str, decode: str, now: float) -> None:
        self.path(prefill, decode).chosen(now)
