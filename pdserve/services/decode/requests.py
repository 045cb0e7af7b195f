"""What a decode worker holds of each request placed on it: one record per request, from the
engine taking it (a reservation for its KV, or its prompt queued here) to its end here
(finished, or cancelled).

Threads: the engine thread opens a record as the engine takes its request — in order with
the cancels' checks, which read `attempt` there — and writes `attempt` and `prefilled_here`;
the event loop writes the rest and closes it. A record is closed once, by whoever holds it
(a finish and a cancel may both try): the end of one placement never drops the next one's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from opentelemetry import trace


@dataclass(eq=False)
class DecodeRequest:
    attempt: int                                  # its placement number (engine thread)
    secret: str = ""                              # the placement's: its chunks signed with it (pdserve/shared/macs.py)
    prefilled_here: bool = False                  # its prompt computed here, not received (engine thread)
    span: trace.Span | None = None                # `decode.generate`, from the admit's reply on
    receiving: asyncio.Task | None = None         # its KV wait, while the KV is on its way
    first_token: tuple[float, int] | None = None  # (when, tokens generated) at its first token here
    closed: bool = False                          # over here (`DecodeRequests.close`)
    crashes: int = 0                              # charged to it so far (the admit's, a requeue's): its
                                                  # first passes run alone (pdserve/shared/quarantine.py)

    def decoding(self, tokens: int) -> None:
        """Its first token here: it is decoding."""
        self.first_token = (time.monotonic(), tokens)

    def time_per_output_token_ms(self, tokens: int) -> float | None:
        """The pace of the tokens made here after the first (None: none made)."""
        if self.first_token is None or tokens <= self.first_token[1]:
            return None
        when, before = self.first_token
        return round(1e3 * (time.monotonic() - when) / (tokens - before), 3)


class DecodeRequests:
    def __init__(self) -> None:
        self.records: dict[str, DecodeRequest] = {}

    def open(self, rid: str, attempt: int, secret: str, crashes: int = 0) -> DecodeRequest:
        """On the engine thread, as the engine takes the request: the record of this placement
        already kept (a failed handoff's, its prompt now prefilled here), else a new one."""
        record = self.records.get(rid)
        if record is None or record.attempt != attempt or record.closed:
            record = self.records[rid] = DecodeRequest(attempt, secret, crashes=crashes)
        return record

    def get(self, rid: str) -> DecodeRequest | None:
        return self.records.get(rid)

    def close(self, rid: str, record: DecodeRequest) -> bool:
        """`record` is over (dropped, unless a newer placement's took its place): whether it was
        open until now."""
        if record.closed:
            return False
        record.closed = True
        if self.records.get(rid) is record:
            del self.records[rid]
        return True

    def receiving(self) -> list[asyncio.Task]:
        """The KV waits under way."""
        return [r.receiving for r in list(self.records.values()) if r.receiving is not None]
