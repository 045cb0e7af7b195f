"""A request's holders: the workers of every one of its placements, read from its events."""

from __future__ import annotations

from shared.holders import Holders
from shared.lifecycle import Event


def test_a_requests_holders_are_every_placements_workers_from_its_events():
    def event(name, by, attempt=0, **fields):
        return Event(t=0, event=name, by=by, attempt=attempt, **fields)

    events = [event("routed", "router", decode="d0", prefill="p0"),
              event("prefilling", "p1"),                       # its `routed` note was lost
              event("transferring", "p1", decode="d2"),
              event("failover", "gw", attempt=1),
              event("routed", "router", attempt=1, decode="d1", prefill=""),
              event("decoding", "d1", attempt=1)]
    h = Holders.of(events)
    assert (h.decode, h.prefill) == ({"d0", "d1", "d2"}, {"p0", "p1"})
