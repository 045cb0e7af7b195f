"""Inputs a careless client or an attacker sends, on the stack: each one a 4xx in OpenAI's
error shape naming its field, with the request's id, never a 5xx; the stack answers normally
after them.
On the session's fake-model stack (tests/stack/conftest.py): what is tested is the gateway's
refusals, not the model's numbers."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import MODEL

pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def _post(stack, body: dict | bytes, headers: dict | None = None, path: str = "/v1/chat/completions") -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(stack.url + path, content=data, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def _refused(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    assert len(r.headers["x-request-id"]) == 32


@pytest.mark.parametrize("key", ["²", "٣", "9" * 5000, "-1", ""])
def test_logit_bias_keys_that_are_no_token_id(stack, key):
    _refused(_post(stack, {"model": MODEL, "messages": HI, "logit_bias": {key: 1}}), 400, "logit_bias")


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
    (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\udfff"]}', "stop.0"),
    (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"\\ud800": 1}}', "logit_bias"),
], ids=["content", "stop", "key"])
def test_lone_surrogates_are_a_400_naming_where(stack, raw, param):
    _refused(_post(stack, raw % MODEL.encode()), 400, param)


@pytest.mark.parametrize("path, raw, param", [
    ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
    ("/detokenize", b'{"tokens": [1], "model": "\\udfff"}', "model"),
    ("/v1/completions", b'{"model": "m", "prompt": ["ok", "a\\ud800b"]}', "prompt.1"),
    ("/v1/responses", b'{"model": "m", "input": "a\\ud800b"}', "input"),
], ids=["tokenize", "tokenize-messages", "detokenize", "completions-batch", "responses"])
def test_every_body_with_a_lone_surrogate_is_a_400_naming_where(stack, path, raw, param):
    _refused(_post(stack, raw, path=path), 400, param)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": HI}, "guided_json"), ("/v1/completions", {"prompt": "hi"}, "guided_json"),
    ("/v1/responses", {"input": "hi"}, "metadata"), ("/tokenize", {}, "messages")])
def test_bodies_nested_up_to_the_parsers_limit_and_past_it_are_a_400(stack, path, body, field):
    """Nesting the JSON parser takes (to about the interpreter's recursion limit, ~970 here) is
    refused by the checks, which walk a body without recursion, naming the field; past it the
    parser refuses the body."""
    for depth in (200, 900, 940, 960, 1000, 5000):
        raw = json.dumps({"model": MODEL, **body, field: None})
        raw = raw.replace(f'"{field}": null', f'"{field}": {"[" * depth}1{"]" * depth}')
        r = _post(stack, raw.encode(), path=path)
        assert r.status_code == 400 and r.json()["error"]["param"] in (field, None if depth > 900 else field), \
            (depth, r.text)


@pytest.mark.parametrize("seed", [2 ** 63, -2 ** 63 - 1, 10 ** 30])
def test_a_seed_outside_int64_is_a_400_naming_it(stack, seed):
    _refused(_post(stack, {"model": MODEL, "messages": HI, "max_tokens": 2, "seed": seed}), 400, "seed")
    _refused(_post(stack, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed}, path="/v1/completions"),
             400, "seed")


def test_caps_on_logit_bias_stop_and_session_header(stack):
    _refused(_post(stack, {"model": MODEL, "messages": HI, "logit_bias": {str(i): 1 for i in range(40_000)}}),
             400, "logit_bias")
    _refused(_post(stack, {"model": MODEL, "messages": HI, "stop": ["x" * 300_000]}), 400, "stop")
    _refused(_post(stack, {"model": MODEL, "messages": HI, "max_tokens": 2}, {"x-session-id": "s" * 5000}),
             400, "x-session-id")


def test_a_chunked_body_over_the_limit_is_a_413_as_it_arrives(stack):
    def chunks():
        yield b'{"model": "%s", "messages": [{"role": "user", "content": "' % MODEL.encode()
        for _ in range(1200):
            yield b"x" * 1024
        yield b'"}]}'

    r = httpx.post(stack.url + "/v1/chat/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    _refused(r, 413, None)


def test_the_stack_answers_normally_after_them(stack):
    r = _post(stack, {"model": MODEL, "messages": HI, "max_tokens": 4, "logit_bias": {"42": 5}, "stop": ["zz"]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
