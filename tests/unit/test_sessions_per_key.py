"""A conversation (`session_id`, x-session-id) is its API key's own: tenant B naming tenant A's
session steers nothing of A's (pdserve/services/gateway/checks.py)."""

from types import SimpleNamespace

from pdserve.services.gateway import checks


def request(key: str | None, header: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(api_key=key), headers={"x-session-id": header} if header else {})


def test_a_session_is_scoped_by_the_key_that_names_it():
    body = SimpleNamespace(session_id="conv-1")
    a, b = checks.session(body, request("tenant-a")), checks.session(body, request("tenant-b"))
    assert a != b and "conv-1" in a and "tenant-a" in a
    assert checks.session(SimpleNamespace(session_id=None), request("tenant-a", "conv-1")) == a   # the header alike


def test_without_keys_or_a_session_nothing_changes():
    assert checks.session(SimpleNamespace(session_id="conv-1"), request(None)) == "conv-1"   # the open world
    assert checks.session(SimpleNamespace(session_id=None), request("tenant-a")) is None
