"""`make chaos`'s faults of the bus and the store in CI, on the HA stack (pdserve/local/ha.py:
3 NATS nodes with the prefill job stream on all of them, a Redis primary and replica under 3
Sentinels): 100 concurrent greedy requests through kill -9 of the NATS node the gateway is on
and of the Redis primary. Every request completes equal to its run without faults, no KV block
stays taken, no other process dies, the clients carry on on the nodes left and the
Sentinels promote the replica."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from bench.chaos.scenarios import HA_SCENARIOS, main_async

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def test_every_request_survives_the_loss_of_a_nats_node_and_of_the_redis_primary():
    results = asyncio.run(main_async(argparse.Namespace(requests=100, max_tokens=16, kv_blocks=1024,
                                                        scenarios=list(HA_SCENARIOS))))
    assert [(r["scenario"], r["stack"]) for r in results] == [(s, "ha") for s in HA_SCENARIOS]
    for r in results:
        assert r["collateral"] == {}, r
        assert (r["lost"], r["mismatched"], r["leaked_blocks"]) == (0, 0, 0), r
        assert r["streams_in_flight"] > 0, r
        assert r["missing_after"] == [], r      # every worker back in the registry, its pool empty
    node, primary = results
    assert node["victim"].startswith("nats-") and primary["victim"] in ("redis", "redis-replica")
    # the Sentinels promoted the replica (the old primary came back as its replica after the load)
    assert primary["promoted"] in ("redis", "redis-replica") and primary["promoted"] != primary["victim"], primary
    # the gateway's chunks lost with its node are published again by their decode workers
    assert node["moved"].get("replays:replayed", 0) > 0, node
