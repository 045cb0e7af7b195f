"""One trace per request across the gateway, router, prefill and decode processes.
On the session's fake-model stack (tests/stack/conftest.py): what is tested is the trace's spans and
links, not the model's numbers."""

from __future__ import annotations

import time

import pytest
from conftest import MODEL

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(fake_client):
    return fake_client


def test_one_trace_spans_every_service_with_parent_links(client, otlp):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], temperature=0, max_tokens=8)
    trace_id = raw.headers["x-trace-id"]
    wanted = {"gateway.request", "router.route", "decode.admit", "prefill.queue", "prefill.compute",
              "kv.transfer", "kv.receive", "decode.generate"}
    spans = {s.name: s for s in otlp.wait_for(trace_id, wanted)}
    assert wanted <= set(spans), sorted(spans)
    assert {s.service for s in spans.values()} == {"pdserve-gateway", "pdserve-router", "pdserve-prefill",
                                                   "pdserve-decode"}
    by_id = {s.span_id: s for s in otlp.trace(trace_id)}
    parent = lambda name: by_id[spans[name].parent_id].name  # noqa: E731
    roots = [s for s in otlp.trace(trace_id) if s.parent_id == ""]
    assert [r.service for r in roots] == ["pdserve-gateway"]  # one root: the HTTP request at the gateway
    assert spans["gateway.request"].parent_id in ("", roots[0].span_id)
    assert spans["gateway.request"].attributes["request_id"] == raw.headers["x-request-id"]
    assert by_id[spans["router.route"].parent_id].service == "pdserve-gateway"
    assert parent("decode.admit") == "router.route"
    assert parent("prefill.compute") == "router.route"
    assert parent("kv.transfer") == "router.route"   # alongside the prefill: layers stream as computed
    assert parent("decode.generate") == "router.route"
    assert parent("kv.receive") == "decode.generate"
    transfer, receive = spans["kv.transfer"].attributes, spans["kv.receive"].attributes
    assert transfer["bytes"] > 0 and transfer["transport"] == "segment" and transfer["acked"] is True
    assert transfer["segment_bytes"] == transfer["bytes"]   # one host: through the prefill worker's segment
    assert 0 <= transfer["exposed_ms"] < spans["kv.transfer"].duration_ms
    assert receive["bytes"] == transfer["bytes"] and receive["ok"] is True and receive["bad_blocks"] == 0
    assert spans["kv.transfer"].start_ns < spans["prefill.compute"].end_ns
    assert spans["router.route"].attributes["mode"] == "remote"


def test_the_gateway_makes_no_trace_beside_the_requests(client, otlp):
    """Every span the gateway exports is in a request's trace (its `gateway.request`'s): no
    framework span starts a trace of its own."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=2)
    otlp.wait_for(raw.headers["x-trace-id"], {"gateway.request", "decode.generate"})
    time.sleep(1.0)  # (the exporters' batches: any other span of the request is in by now)
    requests = {s.trace_id for s in otlp.spans if s.name == "gateway.request"}
    stray = [s.name for s in otlp.spans if s.service == "pdserve-gateway" and s.trace_id not in requests]
    assert not stray, stray
