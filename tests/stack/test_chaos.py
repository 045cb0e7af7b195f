"""`make chaos`'s scenarios as assertions (`pytest -m chaos`, ~5 minutes with the HA ones; `make test`
leaves them out): 100 concurrent greedy requests on 2 prefill + 2 decode workers through
each fault (kill -9 a prefill worker, a decode worker, every prefill worker; restart NATS;
restart Redis): every
request completes, equal to its run without faults, no KV block stays taken, and no other
process dies with the one hit. Streams that lost chunks with NATS get them again from their
decode worker."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from bench.chaos.scenarios import SCENARIOS, main_async

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


def test_every_request_survives_each_fault_exactly():
    results = asyncio.run(main_async(argparse.Namespace(requests=100, max_tokens=16, kv_blocks=1024,
                                                        scenarios=list(SCENARIOS))))
    assert [r["scenario"] for r in results] == list(SCENARIOS)
    for r in results:
        assert r["collateral"] == {}, r         # no other process died with the one hit
        assert (r["lost"], r["mismatched"], r["leaked_blocks"]) == (0, 0, 0), r
        assert r["streams_in_flight"] > 0, r   # the fault did strike mid-load
        assert r["missing_after"] == [], r
    nats = results[SCENARIOS.index("restart-nats")]
    # chunks lost with the bus are published again by their decode worker, not recomputed
    assert nats["moved"].get("replays:replayed", 0) > 0, nats
    # with no prefill worker left, the decode workers prefill (the last resort), and nothing else does
    assert results[SCENARIOS.index("kill-prefill-pool")]["local_recomputes"] > 0
    assert results[SCENARIOS.index("kill-prefill")]["local_recomputes"] == 0
