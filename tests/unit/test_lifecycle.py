"""A request's status from its events, phase deadlines, the supervisor's verdicts, and the
timeline an operator reads."""

from pdserve.shared.lifecycle import Event, deadline_s, summarize, verdict
from pdserve.shared.tools.timeline import render


def ev(t, event, attempt=0, by="", **fields):
    return Event(t=t, event=event, attempt=attempt, by=by, **fields)


REMOTE = [ev(0.0, "received", by="gw", owner="gw"), ev(0.1, "routed", by="router", decode="d0", prefill="p0"),
          ev(0.2, "prefilling", by="p0"), ev(1.0, "transferring", by="p0"), ev(1.1, "decoding", by="d0")]


def test_status_is_the_furthest_phase_of_the_latest_attempt_whatever_order_the_writes_landed_in():
    s = summarize(list(reversed(REMOTE)))
    assert (s.phase, s.attempt, s.owner, s.decode, s.prefill, s.since) == ("decoding", 0, "gw", "d0", "p0", 1.1)
    # a failover starts again: routed under attempt 1 outranks attempt 0's decoding
    moved = REMOTE + [ev(2.0, "failover", attempt=1, by="gw"), ev(2.1, "routed", attempt=1, decode="d1")]
    s = summarize(moved)
    assert (s.phase, s.attempt, s.decode, s.prefill) == ("routed", 1, "d1", "")
    # a late write of the old attempt does not move it back
    assert summarize(moved + [ev(2.2, "decoding", attempt=0, by="d0")]).phase == "routed"
    assert summarize(moved + [ev(3.0, "finished", attempt=1)]).phase == "finished"


def test_deadlines_allow_the_prompt_before_the_first_token_and_stall_s_between_tokens():
    assert deadline_s("received", 1000, 30, 50) is None and deadline_s("finished", 10, 30, 50) is None
    assert deadline_s("routed", 1000, 30, 50) == 30 + 5 + 20
    assert deadline_s("prefilling", 0, 30, 50) == deadline_s("prefill_local", 0, 30, 50) == 35
    assert deadline_s("decoding", 1000, 30, 50) == 30


def test_verdicts():
    decoding = summarize(REMOTE)
    assert verdict(decoding, owner_alive=True, decode_alive=True) == "stalled"
    assert verdict(decoding, owner_alive=True, decode_alive=False) == "wait"     # the gateway moves it on the lease
    assert verdict(decoding, owner_alive=False, decode_alive=True) == "abandoned"
    assert verdict(summarize(REMOTE[:1]), owner_alive=True, decode_alive=False) == "wait"   # being placed
    # moved by the gateway, the new placement not yet made: its old phase is no stall of the new one
    moving = summarize(REMOTE + [ev(2.0, "failover", attempt=1, by="gw")])
    assert (moving.phase, moving.attempt, moving.latest_attempt) == ("decoding", 0, 1)
    assert verdict(moving, owner_alive=True, decode_alive=True) == "wait"
    assert verdict(summarize(REMOTE + [ev(5, "cancelled")]), owner_alive=False, decode_alive=False) == "forget"
    assert verdict(summarize([]), owner_alive=True, decode_alive=True) == "forget"   # its events expired
    # reported stalled a period ago and not moved since: nobody acts on the word
    reported = summarize(REMOTE + [ev(3, "stalled", by="router")])
    assert verdict(reported, owner_alive=True, decode_alive=True) == "unheeded"
    moved = REMOTE + [ev(3, "stalled"), ev(3.1, "failover", attempt=1), ev(3.2, "routed", attempt=1, decode="d1")]
    assert verdict(summarize(moved), owner_alive=True, decode_alive=True) == "stalled"   # the new placement's first


def test_the_timeline_lists_every_event_from_the_first_and_the_outcome():
    text = render("r1", REMOTE + [ev(2.0, "failover", attempt=1, by="gw", why="worker lost"),
                                  ev(2.1, "routed", attempt=1, by="router", decode="d1", mode="local"),
                                  ev(2.5, "finished", attempt=1, by="gw", owner="gw", tokens=40)])
    lines = text.splitlines()
    assert lines[0] == "request r1: finished after 2.500 s; attempts 2; gateway gw"
    assert [ln.split()[2] for ln in lines[1:]] == ["received", "routed", "prefilling", "transferring", "decoding",
                                                   "failover#1", "routed#1", "finished#1"]
    assert "   +2.000 s" in lines[6] and "why=worker lost" in lines[6] and "decode=d1 mode=local" in lines[7]
    assert render("r2", []).startswith("request r2: no events")


def test_the_kv_deadline_follows_the_predicted_prefill_within_its_floor_and_ceiling():
    from pdserve.shared.lifecycle import kv_deadline_s

    assert kv_deadline_s(4.0, factor=3, floor_s=5, ceiling_s=30) == 12.0
    assert kv_deadline_s(0.1, factor=3, floor_s=5, ceiling_s=30) == 5.0      # a short prompt: the floor
    assert kv_deadline_s(60.0, factor=3, floor_s=5, ceiling_s=30) == 30.0    # a deep queue: the ceiling
    assert kv_deadline_s(0.0, factor=3, floor_s=5, ceiling_s=30) == 30.0     # no prediction: the ceiling
