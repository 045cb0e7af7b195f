"""A client's ids continue through the stack: its `x-request-id` is the request's id (in the
response, the timeline and the spans), and its `traceparent`, `tracestate` and `baggage` carry
the trace on through every service; the request span speaks OpenTelemetry's GenAI attributes."""

from __future__ import annotations

import json
import secrets

import httpx
import pytest
from conftest import MODEL

from shared.state import log_key
from shared.urls import sync_redis

pytestmark = pytest.mark.slow
HELLO = [{"role": "user", "content": "Name a fruit."}]  # (not another test's prompt: theirs stay uncached)
SERVICES = {"pdserve-gateway", "pdserve-router", "pdserve-prefill", "pdserve-decode"}


def chat(stack, headers: dict, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 6, **extra}
    return httpx.post(stack.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_a_clients_request_id_names_the_request_everywhere(stack, otlp):
    mine = f"app-{secrets.token_hex(6)}"
    r = chat(stack, {"x-request-id": mine})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == mine and r.json()["id"] == f"chatcmpl-{mine}"
    events = [json.loads(e)["event"] for e in sync_redis(stack.redis_url).lrange(log_key(mine), 0, -1)]
    assert events[0] == "received" and "finished" in events, events
    spans = otlp.wait_for(r.headers["x-trace-id"], {"gateway.request", "router.route"})
    assert next(s for s in spans if s.name == "gateway.request").attributes["request_id"] == mine


def test_a_request_id_in_use_gets_a_suffix_and_both_are_served(stack):
    mine = f"again-{secrets.token_hex(6)}"
    first, second = chat(stack, {"x-request-id": mine}), chat(stack, {"x-request-id": mine})
    assert first.status_code == second.status_code == 200, second.text
    assert first.headers["x-request-id"] == mine
    assert second.headers["x-request-id"].startswith(f"{mine}-r") and second.json()["id"].endswith(
        second.headers["x-request-id"])
    # a choice's own id (the first request's choice 1) is taken too: a later request cannot have it
    fan = chat(stack, {"x-request-id": f"{mine}-x"}, n=2)
    assert fan.status_code == 200 and len(fan.json()["choices"]) == 2
    taken = chat(stack, {"x-request-id": f"{mine}-x-1"})
    assert taken.status_code == 200 and taken.headers["x-request-id"] != f"{mine}-x-1"


@pytest.mark.parametrize("bad", ["has.dot", "a" * 65, "spa ce", "star*"])
def test_a_malformed_request_id_is_a_400_naming_the_header(stack, bad):
    r = chat(stack, {"x-request-id": bad})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "x-request-id"
    assert len(r.headers["x-request-id"]) == 32  # (a new id of its own, for the logs)


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
