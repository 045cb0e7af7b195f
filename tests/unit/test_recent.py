from pdserve.services.router.recent import Recent


def test_work_counts_until_the_horizon_and_a_cancelled_entry_not_at_all():
    r = Recent(horizon_s=3.0)
    r.add("p0", 100, now=0.0)
    r.add("p0", 50, now=1.0)
    refused = r.add("p1", 70, now=1.5)
    assert r.totals(2.0) == {"p0": 150, "p1": 70}
    r.cancel(refused)
    assert r.totals(2.0) == {"p0": 150}
    assert r.totals(3.0) == {"p0": 50}          # the first entry is three seconds old
    assert r.totals(4.5) == {} and not r.entries
    late = r.add("p2", 10, now=5.0)
    assert r.totals(9.0) == {}
    r.cancel(late)                               # refused after it expired: nothing left to take back
    assert r.totals(9.0) == {}
