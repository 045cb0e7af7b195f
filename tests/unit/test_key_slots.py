"""Redis keys (pdserve/shared/state/keys.py) on a Redis Cluster: the keys one script touches share a hash
slot (a script's keys on two nodes fail with CROSSSLOT), whatever the ids hold, and requests'
own keys spread over the slots."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from pdserve.shared.state.keys import (
    DEADLINES,
    ENDED,
    GATEWAYS,
    REGISTRY_CHANGES,
    REGISTRY_EPOCH,
    REGISTRY_SEQ,
    WORKERS,
    claim_key,
    log_key,
    owned_key,
    placement_key,
    request_key,
    route_key,
    supervisor_key,
    worker_key,
)


def slots(*keys: str) -> set[int]:
    return {key_slot(k.encode()) for k in keys}


@pytest.mark.parametrize("rid", ["9f2c1e", "client_id-7-p1-2", "a{b}c", "{", "a}"])  # (never empty or "}..."; ids.py)
def test_a_requests_keys_share_a_slot_whatever_its_id(rid):
    assert len(slots(request_key(rid), log_key(rid), supervisor_key(rid))) == 1
    for attempt in (0, 1):
        pk = placement_key(rid, attempt)
        assert len(slots(route_key(pk), claim_key(pk))) == 1


def test_the_registry_is_one_slot_and_the_requests_in_flight_another():
    assert len(slots(worker_key("decode-0"), worker_key("w{x}"), WORKERS, REGISTRY_SEQ, REGISTRY_CHANGES,
                     REGISTRY_EPOCH)) == 1
    assert len(slots(DEADLINES, ENDED, GATEWAYS, owned_key("gateway-1"), owned_key("g{x}"))) == 1


def test_requests_spread_over_the_slots():
    taken = slots(*(request_key(f"req-{i}") for i in range(1000)))
    assert len(taken) > 900
    assert min(taken) < 16384 // 3 and max(taken) > 2 * 16384 // 3
