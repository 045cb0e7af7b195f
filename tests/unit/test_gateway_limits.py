"""The gateway's last line: a failure no handler answers is a 500 in OpenAI's shape with the
request's id (never plain text); the bus away is a 503 with Retry-After; a request whose bus
message would pass the server's payload limit is a 400 naming its largest part."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import nats.errors
import pytest
from fastapi import FastAPI
from opentelemetry import trace

from pdserve.services.gateway import errors
from pdserve.services.gateway.checks import BUS_HEADROOM, check_size
from pdserve.services.gateway.errors import APIError
from pdserve.services.gateway.middleware import RequestContext
from pdserve.services.gateway.relay import Relay, RelayTimings
from pdserve.services.gateway.schemas import ChatCompletionRequest
from pdserve.services.gateway.tools import HERMES
from pdserve.shared.messages import RouteRequest, Sampling


async def _failing(scope, receive, send):
    raise RuntimeError("a bug")


def test_an_unanswered_failure_is_a_500_in_openais_shape_with_the_ids():
    app = RequestContext(_failing, trace.get_tracer("test"), max_bytes=1 << 20)

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return await c.post("/v1/chat/completions", json={})

    r = asyncio.run(call())
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "api_error" and "RuntimeError" in r.json()["error"]["message"]
    assert r.headers["x-request-id"] in r.json()["error"]["message"] and len(r.headers["x-trace-id"]) == 32


@pytest.mark.parametrize("extra, param", [({"stop": ["x" * 1000] * 4}, "stop"),
                                          ({"logit_bias": {str(i): 1 for i in range(900)}}, "logit_bias"),
                                          ({"guided_choice": ["y" * 100] * 60}, "guided_choice")])
def test_a_message_over_the_bus_limit_names_its_largest_part(extra, param):
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **extra})
    req = RouteRequest(request_id="r", prompt_token_ids=list(range(50)), sampling=body.sampling(4), model="m")
    size = len(req.encode())
    gw = SimpleNamespace(bus=SimpleNamespace(nc=SimpleNamespace(max_payload=BUS_HEADROOM + size)), calls=HERMES)
    check_size(gw, body, req)  # (fits exactly)
    gw.bus.nc.max_payload -= 1
    with pytest.raises(APIError) as e:
        check_size(gw, body, req)
    assert e.value.status == 400 and e.value.param == param and str(size) in e.value.message


class _BusAway:
    """A bus whose server is away: subscribing buffers, requests fail as nats.py's do."""

    def __init__(self, error: Exception):
        self.error, self.published = error, []

    async def subscribe(self, subject, cb):
        return SimpleNamespace(unsubscribe=_nothing)

    async def request(self, subject, msg, reply_type, timeout):
        raise self.error

    async def publish(self, subject, msg, ctx=None, secret=""):
        raise self.error


async def _nothing():
    pass


@pytest.mark.parametrize("error", [nats.errors.TimeoutError(), nats.errors.NoRespondersError(),
                                   nats.errors.OutboundBufferLimitError(), nats.errors.ConnectionClosedError()],
                         ids=["timeout", "no-responders", "buffer-full", "closed"])
def test_a_bus_away_is_a_503_with_retry_after(error):
    app = FastAPI()
    errors.install(app)
    relay = Relay(_BusAway(error), RelayTimings(0.01, 10, placement_retry_s=0))

    @app.post("/v1/chat/completions")
    async def place() -> None:
        await relay.run(RouteRequest(request_id="r", prompt_token_ids=[1], sampling=Sampling(max_tokens=1), model="m"))

    async def call():
        wrapped = RequestContext(app, trace.get_tracer("test"), max_bytes=1 << 20)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=wrapped), base_url="http://gw") as c:
            return await c.post("/v1/chat/completions", json={})

    r = asyncio.run(call())
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "service_unavailable" and int(r.headers["retry-after"]) >= 1
