"""One request's story from the state store, without Jaeger:

    python -m pdserve.shared.tools.timeline <request_id> [--redis-url URL] [--json]

prints each event (received, routed, prefilling, transferring, decoding, failover, stalled,
finished...) with its time from the first, the service that recorded it and its fields, then
the request's status. The Redis URL comes from `--redis-url` or PD_REDIS_URL; the local stack
(`make run`) writes its own to `.run/stack.env` (`set -a; . .run/stack.env`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from pdserve.shared import lifecycle
from pdserve.shared.config import Common
from pdserve.shared.lifecycle import Event
from pdserve.shared.state import State


def render(request_id: str, events: list[Event]) -> str:
    """The timeline as text (pure: the tests and the CLI share it)."""
    if not events:
        return f"request {request_id}: no events (unknown id, or older than a day)"
    events = sorted(events, key=lambda e: e.t)
    s = lifecycle.summarize(events)
    t0 = events[0].t
    ended = f"{s.phase} after {events[-1].t - t0:.3f} s" if s.phase in lifecycle.TERMINAL else f"{s.phase} (in flight)"
    lines = [f"request {request_id}: {ended}; attempts {s.latest_attempt + 1}; gateway {s.owner or '-'}"]
    for e in events:
        fields = " ".join(f"{k}={v}" for k, v in e.fields.items() if v not in ("", None))
        attempt = f"#{e.attempt}" if e.attempt else ""
        lines.append(f"  {f'+{e.t - t0:.3f}':>9} s  {e.event + attempt:<16} {e.by:<18} {fields}".rstrip())
    return "\n".join(lines)


async def fetch(url: str, request_id: str) -> list[Event]:
    state = State.connect(url)
    try:
        return await state.requests.events(request_id)
    finally:
        await state.close()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Print one request's timeline from the state store.")
    ap.add_argument("request_id", help="the x-request-id response header (or the response id without its prefix)")
    ap.add_argument("--redis-url", default=None, help="default: PD_REDIS_URL")
    ap.add_argument("--json", action="store_true", help="the raw events as JSON lines")
    args = ap.parse_args(argv)
    rid = args.request_id.removeprefix("chatcmpl-").removeprefix("cmpl-")
    events = asyncio.run(fetch(args.redis_url or Common().redis_url, rid))
    if args.json:
        for e in sorted(events, key=lambda e: e.t):
            print(json.dumps(e.model_dump()))
    else:
        print(render(rid, events))
    return 0 if events else 1


if __name__ == "__main__":
    sys.exit(main())
