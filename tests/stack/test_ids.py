"""A client's ids continue through the stack: its `x-request-id` comes back beside the
server's (which names the request in the timeline and the spans), and its `traceparent`,
`tracestate` and `baggage` carry the trace on through every service; the request span speaks
OpenTelemetry's GenAI attributes.
On the session's fake-model stack (tests/stack/conftest.py): what is tested is the ids, the trace
context and the spans' attributes, not the model's numbers."""

from __future__ import annotations

import json
import secrets

import httpx
import pytest
from conftest import MODEL

from pdserve.shared.state import log_key
from pdserve.shared.urls import sync_redis

pytestmark = pytest.mark.slow
HELLO = [{"role": "user", "content": "Name a fruit."}]  # (not another test's prompt: theirs stay uncached)
SERVICES = {"pdserve-gateway", "pdserve-router", "pdserve-prefill", "pdserve-decode"}


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def chat(stack, headers: dict, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 6, **extra}
    return httpx.post(stack.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_the_request_id_is_the_servers_and_the_clients_comes_back(stack, otlp):
    """A client's `x-request-id` names nothing inside (no subject, no key): the request gets a
    uuid of the server's, in the response, the timeline and the spans; the client's id is the
    span's `client_request_id` and comes back in `x-client-request-id`. The same id sent twice
    is two requests, both served, neither told of the other."""
    mine = f"app.{secrets.token_hex(6)}:7"   # (any visible ASCII: it names no subject)
    first, second = chat(stack, {"x-request-id": mine}), chat(stack, {"x-client-request-id": mine})
    assert first.status_code == second.status_code == 200, second.text
    rids = [r.headers["x-request-id"] for r in (first, second)]
    assert all(len(rid) == 32 and mine not in rid for rid in rids) and rids[0] != rids[1]
    assert first.headers["x-client-request-id"] == second.headers["x-client-request-id"] == mine
    assert first.json()["id"] == f"chatcmpl-{rids[0]}"
    store = sync_redis(stack.redis_url)
    events = [json.loads(e)["event"] for e in store.lrange(log_key(rids[0]), 0, -1)]
    assert events[0] == "received" and "finished" in events, events
    assert not store.keys(f"*{mine}*")
    spans = otlp.wait_for(first.headers["x-trace-id"], {"gateway.request", "router.route"})
    request = next(s for s in spans if s.name == "gateway.request")
    assert request.attributes["request_id"] == rids[0] and request.attributes["client_request_id"] == mine


@pytest.mark.parametrize("bad", [b"a" * 129, b"spa ce", "caf\u00e9".encode("latin-1")])
def test_a_malformed_client_request_id_is_a_400_naming_the_header(stack, bad):
    r = chat(stack, {"x-client-request-id": bad})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "x-client-request-id"
    assert len(r.headers["x-request-id"]) == 32 and "x-client-request-id" not in r.headers


def test_traceparent_tracestate_and_baggage_continue_through_every_service(stack, otlp):
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    fresh = [{"role": "user", "content": f"Tell me about the number {trace_id}."}]  # (no cached prefix: prefilled)
    r = chat(stack, {"traceparent": f"00-{trace_id}-{parent}-01", "tracestate": "vendor=abc,other=1",
                     "baggage": "app.tenant=blue,secret.key=hidden"}, messages=fresh)
    assert r.status_code == 200 and r.headers["x-trace-id"] == trace_id
    wanted = {"gateway.request", "router.route", "prefill.compute", "decode.generate"}
    spans = {s.name: s for s in otlp.wait_for(trace_id, wanted)}
    assert wanted <= set(spans), sorted(spans)
    assert spans["gateway.request"].parent_id == parent  # the caller's span is the parent
    assert {s.service for s in spans.values()} == SERVICES
    for span in spans.values():
        assert span.trace_state == "vendor=abc,other=1", span.name
        assert span.attributes.get("app.tenant") == "blue", span.name  # (PD_TRACE_BAGGAGE_KEYS names it)
        assert "secret.key" not in span.attributes  # (one not named stays out of the spans)


def test_the_request_span_has_genai_attributes(stack, otlp):
    r = chat(stack, {}, seed=7, stop=["\n\n"])
    usage = r.json()["usage"]
    attrs = otlp.attributes(r.headers["x-trace-id"], {"gateway.request"})["gateway.request"]
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.request.max_tokens"] == 6 and attrs["gen_ai.request.seed"] == 7
    assert attrs["gen_ai.request.stop_sequences"] == ["\n\n"]
    assert attrs["gen_ai.response.id"] == r.json()["id"]
    assert attrs["gen_ai.response.finish_reasons"] == [r.json()["choices"][0]["finish_reason"]]
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
