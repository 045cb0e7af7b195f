"""What every route needs, held once per process and injected with Annotated aliases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from opentelemetry import trace

from pdserve.services.gateway.auth import KeyCheck
from pdserve.services.gateway.concurrency import Concurrency
from pdserve.services.gateway.ratelimit import RateLimit
from pdserve.services.gateway.relay import Relay
from pdserve.services.gateway.tools import CallFormat
from pdserve.shared.bus import Bus
from pdserve.shared.config import GatewaySettings
from pdserve.shared.engine.config import ModelConfig
from pdserve.shared.engine.tokenizer import Tokenizer
from pdserve.shared.state import State


@dataclass
class Gateway:
    settings: GatewaySettings
    bus: Bus
    state: State
    tokenizer: Tokenizer
    model_config: ModelConfig
    calls: CallFormat       # how the model writes tool calls (tools.call_format)
    relay: Relay
    keys: KeyCheck
    rate_limit: RateLimit   # requests per caller per second
    token_limit: RateLimit  # tokens (prompt + n x max_tokens) per caller per second
    in_flight: Concurrency  # requests in flight per caller


async def _gateway(request: Request) -> Gateway:  # (async: FastAPI runs a plain def in its thread pool)
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]


async def authorize(request: Request, gw: GatewayDep) -> None:
    """Every /v1 route: a known API key (unless the API is open), then the caller's rate limit.
    The key's name goes on the span; the key itself is never logged or recorded."""
    caller = gw.keys.identify(request.headers.get("authorization"))
    request.state.api_key = caller  # (its name: the prefix cache's partition, checks.cache_salt)
    request.state.caller = caller or f"addr:{request.client.host if request.client else '-'}"
    if caller is not None:
        trace.get_current_span().set_attribute("api_key", caller)
    await gw.rate_limit.take(request.state.caller)
