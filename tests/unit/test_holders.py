"""A request's holders: the workers of every one of its placements, read from its events."""

from __future__ import annotations

from pdserve.shared.holders import Holders
from pdserve.shared.lifecycle import Event


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
    assert (set(h.decode), set(h.prefill)) == ({"d0", "d1", "d2"}, {"p0", "p1"})


def test_the_gateways_cancel_goes_signed_once_per_placement_held_and_the_supervisors_on_its_own_subjects():
    """A worker takes a cancel only with the MAC of a placement it holds (pdserve/shared/macs.py): the
    gateway signs one for each of a worker's placements; the supervisor's goes on the subjects
    only routers may publish to."""
    import asyncio

    from pdserve.shared.messages import Cancel

    sent = []

    class Bus:
        async def publish(self, subject, msg, ctx=None, secret=""):
            sent.append((subject, secret))

    h = Holders()
    h.add("d0", "p0", "s0")
    h.add("d0", None, "s1")          # a failover placed on the same decode worker
    h.add("d1", secret="s1")
    asyncio.run(h.cancel(Bus(), Cancel(request_id="r")))
    assert sent == [("pd.decode.d0.cancel", "s0"), ("pd.decode.d0.cancel", "s1"), ("pd.decode.d1.cancel", "s1"),
                    ("pd.prefill.p0.cancel", "s0")]
    sent.clear()
    asyncio.run(h.cancel_as_supervisor(Bus(), Cancel(request_id="r")))
    assert sent == [("pd.decode.d0.cancel.supervisor", ""), ("pd.decode.d1.cancel.supervisor", ""),
                    ("pd.prefill.p0.cancel.supervisor", "")]
