"""A process counts as gone once missing from the registry for a while, not at one look."""

from pdserve.shared.absence import Absence


def test_gone_only_after_missing_for_the_confirmation_time():
    a = Absence(confirm_s=1.5)
    assert not a.gone("w", present=False, now=10.0)   # one look: a Redis restarted empty looks like this
    assert not a.gone("w", present=False, now=11.0)
    assert a.gone("w", present=False, now=11.5)


def test_a_look_that_finds_it_starts_over():
    a = Absence(confirm_s=1.5)
    a.gone("w", present=False, now=10.0)
    assert not a.gone("w", present=True, now=11.0)
    assert not a.gone("w", present=False, now=12.0)
    assert a.gone("w", present=False, now=13.5)


def test_each_process_is_timed_on_its_own_and_can_be_forgotten():
    a = Absence(confirm_s=1.0)
    a.gone("a", present=False, now=0.0)
    a.gone("b", present=False, now=0.5)
    assert a.gone("a", present=False, now=1.0) and not a.gone("b", present=False, now=1.0)
    a.forget("a")
    assert not a.gone("a", present=False, now=1.2)
