"""API keys: hashed in configuration, checked per request, a malformed entry refused."""

from __future__ import annotations

import pytest

from pdserve.services.gateway import auth
from pdserve.services.gateway.errors import APIError


def test_keys_are_configured_hashed_and_checked(capsys):
    auth.main(["new", "alice"])
    out = capsys.readouterr().out
    key = out.split("key (shown once, give it to the client): ")[1].split()[0]
    entry = out.split("config entry (add to PD_API_KEYS, comma-separated): ")[1].split()[0]
    assert key.startswith("pd-") and entry == f"alice:{auth.hash_key(key)}" and key not in entry
    check = auth.KeyCheck(f"{entry}, bob:{auth.hash_key('pd-other')}")
    assert check.identify(f"Bearer {key}") == "alice" and check.identify("bearer pd-other") == "bob"
    for header, code in ((None, "missing_api_key"), ("Basic abc", "missing_api_key"), ("Bearer ", "missing_api_key"),
                         ("Bearer pd-wrong", "invalid_api_key"), (f"Bearer {key}x", "invalid_api_key")):
        with pytest.raises(APIError) as err:
            check.identify(header)
        assert err.value.status == 401 and err.value.code == code
    assert auth.KeyCheck("").open and auth.KeyCheck("").identify(None) is None


def test_a_malformed_key_entry_stops_the_start():
    with pytest.raises(ValueError, match="expected name:<64 hex digits"):
        auth.KeyCheck("alice:notahash")
    with pytest.raises(ValueError):
        auth.KeyCheck(auth.hash_key("k"))   # no name
