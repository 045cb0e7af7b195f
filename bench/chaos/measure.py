"""What a fault cost (bench/chaos/scenarios.py), from each stream's token arrival times, the same
request's arrival times in the run without faults, and its events: pure functions. Times are
seconds from the request's start (all requests of a run start together).

- *Moved* streams: failed over (`failover` event), their prefill job requeued off a lost
  prefill worker (a `routed` event whose reason says `requeued`), or prefilled on their
  decode worker instead (`prefill_local`: no prefill worker left to take the job).
- `moved_recovery_s`: when the last moved stream got its next token after the fault.
- `moved_delay_s`: the most a moved stream's last token came later than without the fault
  (what the move cost it, queueing it would have had anyway excluded).
- *Survivors*: the streams in flight at the fault that were not moved. Their inter-token p99
  during the recovery (gaps ending between the fault and the recovery's end) over their p99
  before the fault (`itl_p99_during_over_before`), and over the same requests' p99 in the
  same window of the run without faults (`itl_p99_during_over_reference`: the load's own
  ramp excluded).
- `local_recomputes`: prompts prefilled on a decode worker because of the fault (a handoff's
  fallback, or a failover placed there with no prefill worker).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Stream:
    times: list[float]       # arrival of each frame with tokens, from the request's start
    reference: list[float]   # the same in the run without faults
    events: list[dict]       # the request's events (pdserve/shared/lifecycle.py)


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
    return any(e["event"] in ("failover", "prefill_local")
               or (e["event"] == "routed" and "requeued" in e.get("reason", "")) for e in events)


def local_recomputes(events: list[dict]) -> int:
    """Prompts of this request prefilled on a decode worker after a fault."""
    return sum(1 for e in events if e["event"] == "prefill_local"
               or (e["event"] == "routed" and e.get("mode") == "local" and e.get("attempt", 0) > 0))


def rounded(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def cost(streams: list[Stream], fault_at: float) -> dict:
    """The recovery of the moved streams and what it cost the survivors (`fault_at`: seconds
    from the start of the run)."""
    def in_flight(s: Stream) -> bool:
        return bool(s.times) and s.times[0] <= fault_at < s.times[-1]

    def next_token(s: Stream) -> float:
        return next((t for t in s.times if t > fault_at), fault_at)

    moving = [s for s in streams if moved(s.events) and s.times]
    survivors = [s for s in streams if in_flight(s) and not moved(s.events)]
    recovered_at = max((next_token(s) for s in moving or [s for s in streams if in_flight(s)]), default=fault_at)
    before = p99([g for s in survivors for g in gaps(s.times, -math.inf, fault_at)])
    during = p99([g for s in survivors for g in gaps(s.times, fault_at, recovered_at)])
    reference = p99([g for s in survivors for g in gaps(s.reference, fault_at, recovered_at)])
    return {"moved_streams": len(moving), "moved_recovery_s": round(recovered_at - fault_at, 2),
            "moved_delay_s": round(max((s.times[-1] - s.reference[-1] for s in moving if s.reference), default=0), 2),
            "survivors": len(survivors),
            "itl_p99_before_s": rounded(before), "itl_p99_during_s": rounded(during),
            "itl_p99_reference_s": rounded(reference),
            "itl_p99_during_over_before": ratio(during, before),
            "itl_p99_during_over_reference": ratio(during, reference),
            "local_recomputes": sum(local_recomputes(s.events) for s in streams)}
