"""What a fault cost (bench/chaos.py), from each stream's token arrival times and its request's
events: pure functions.

- *Moved* streams: a failover (`failover` event) or a prefill job requeued off a lost prefill
  worker (a `routed` event whose reason says `requeued`).
- *Recovered at*: when the last moved stream got its next token after the fault.
- *Survivors*: the streams in flight at the fault that were not moved; their inter-token gaps
  during the recovery (ending between the fault and `recovered at`) against those before it
  (p99 each) say what the recovery cost everyone else.
- *Local recomputes*: prompts prefilled on a decode worker because of the fault (a handoff's
  fallback, or a failover placed there with no prefill worker).
"""

from __future__ import annotations

import math


def p99(xs: list[float]) -> float | None:
    """Nearest-rank 99th percentile; None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]


def gaps(times: list[float], after: float, until: float) -> list[float]:
    """Inter-token gaps of one stream that end in (after, until]."""
    return [b - a for a, b in zip(times, times[1:]) if after < b <= until]


def moved(events: list[dict]) -> bool:
    return any(e["event"] == "failover" or (e["event"] == "routed" and "requeued" in e.get("reason", ""))
               for e in events)


def local_recomputes(events: list[dict]) -> int:
    """Prompts of this request prefilled on a decode worker after a fault."""
    return sum(1 for e in events if e["event"] == "prefill_local"
               or (e["event"] == "routed" and e.get("mode") == "local" and e.get("attempt", 0) > 0))


def cost(streams: list[tuple[list[float], list[dict]]], fault_at: float) -> dict:
    """From (token arrival times, request events) per request: the recovery of the moved
    streams and what it cost the survivors."""
    def next_token(times: list[float]) -> float | None:
        return next((t for t in times if t > fault_at), None)

    moved_next = [t for times, events in streams if moved(events) and (t := next_token(times)) is not None]
    in_flight = [times for times, events in streams if times and times[0] <= fault_at < times[-1]]
    survivors = [times for times, events in streams
                 if times and times[0] <= fault_at < times[-1] and not moved(events)]
    recovered_at = max(moved_next, default=max((next_token(t) or fault_at for t in in_flight), default=fault_at))
    before = p99([g for times in survivors for g in gaps(times, -math.inf, fault_at)])
    during = p99([g for times in survivors for g in gaps(times, fault_at, recovered_at)])
    return {"moved_streams": len(moved_next), "moved_recovery_s": round(recovered_at - fault_at, 2),
            "survivors": len(survivors),
            "itl_p99_before_s": round(before, 3) if before is not None else None,
            "itl_p99_during_s": round(during, 3) if during is not None else None,
            "itl_p99_during_over_before": round(during / before, 2) if before and during is not None else None,
            "local_recomputes": sum(local_recomputes(events) for _, events in streams)}
