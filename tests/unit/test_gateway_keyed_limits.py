"""With API keys set, the per-key limits left unset take KEYED_LIMITS (docs/API.md), so one key
cannot take the whole service; a limit set (0 included: off on purpose) stays as set; with no
keys every limit stays off unless set. From arguments, the environment and `pdserve gateway`'s
flags alike."""

from __future__ import annotations

import pytest

from pdserve.services.cli import parse
from pdserve.shared.config import KEYED_LIMITS, GatewaySettings

KEYS = "alice:" + "0" * 64
LIMITS = tuple(KEYED_LIMITS)


def limits(s: GatewaySettings) -> dict[str, float]:
    return {name: getattr(s, name) for name in LIMITS}


def test_keys_set_unset_limits_take_the_keyed_defaults():
    assert limits(GatewaySettings(api_keys=KEYS)) == KEYED_LIMITS
    assert all(value > 0 for value in KEYED_LIMITS.values())


def test_no_keys_every_limit_is_off():
    assert limits(GatewaySettings()) == dict.fromkeys(LIMITS, 0)


def test_a_limit_set_stays_as_set_zero_included(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PD_API_KEYS", KEYS)
    monkeypatch.setenv("PD_MAX_CONCURRENT_PER_KEY", "0")
    s = GatewaySettings(rate_limit_per_s=3)
    assert (s.rate_limit_per_s, s.max_concurrent_per_key) == (3, 0)
    assert s.max_tokens_limit == KEYED_LIMITS["max_tokens_limit"]
    _, flagged = parse(["gateway", "--token-rate-limit-per-s", "0"])
    assert isinstance(flagged, GatewaySettings)
    assert flagged.token_rate_limit_per_s == 0 and flagged.rate_limit_per_s == KEYED_LIMITS["rate_limit_per_s"]
