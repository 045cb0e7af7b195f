"""Gateway: the OpenAI-compatible HTTP front door.

1. Start: serve /health, /ready and /metrics on `metrics_host:metrics_port` (pdserve/shared/probes.py),
   load the tokenizer and chat template (no weights), connect to NATS and Redis, judge readiness
   in the background (readiness.py), serve the API on `gateway_host:gateway_port`.
2. Request: open the root span; on /v1 check the API key (401) and the caller's rate limit
   (429 + Retry-After, a token bucket in Redis); validate (4xx in OpenAI's error shape,
   nothing reaches a worker), render the chat template, tokenize, check the length limits.
3. Subscribe to `pd.tokens.<rid>`, then ask the router for a placement (`pd.router.route`).
4. Relay the token chunks in sequence order as SSE or one JSON body, with usage and
   finish_reason; request id and trace id go back in the `x-request-id` / `x-trace-id` headers.
5. A client that disconnects cancels the request on its workers (`pd.decode.<w>.cancel`,
   `pd.prefill.<p>.cancel`: every placement's, pdserve/shared/holders.py). The gateway heartbeats a
   registry lease (role `gateway`) and files each request under it: if the gateway dies, the
   routers' supervisor cancels its requests.
6. A decode worker lost mid-stream (its lease lapsed while no token came): place the request
   again with the tokens so far; another decode worker continues it (relay.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI
from opentelemetry import trace
from uvicorn.config import STARTUP_FAILURE

from pdserve.services.gateway import connections, errors, readiness, tools
from pdserve.services.gateway.api import ops, tokens, v1
from pdserve.services.gateway.auth import KeyCheck
from pdserve.services.gateway.concurrency import Concurrency
from pdserve.services.gateway.deps import Gateway
from pdserve.services.gateway.middleware import RequestContext
from pdserve.services.gateway.ratelimit import RateLimit
from pdserve.services.gateway.relay import Relay
from pdserve.shared import identity, metrics, metrics_vllm, tracing
from pdserve.shared.bus import Bus
from pdserve.shared.config import GatewaySettings
from pdserve.shared.engine import grammar
from pdserve.shared.engine.config import ModelConfig
from pdserve.shared.engine.sources import inspect
from pdserve.shared.engine.tokenizer import Tokenizer, template_text
from pdserve.shared.messages import WorkerInfo
from pdserve.shared.probes import PROBES
from pdserve.shared.service import heartbeat, serving, setup_logging
from pdserve.shared.state import State
from pdserve.shared.tasks import every

log = logging.getLogger("gateway")


def create_app(settings: GatewaySettings) -> FastAPI:
    keys = KeyCheck(settings.api_keys)  # a malformed entry stops the start, before any request
    metrics_vllm.register(settings.model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tick = asyncio.create_task(PROBES.tick())   # /health's stamp, from the start (loading the model)
        metrics.serve(settings.metrics_port, settings.metrics_host)
        tracing.setup("gateway", settings.otlp_endpoint, settings.trace_baggage_keys)
        model_config, tokenizer = await load_model(settings)
        enrolled = identity.mine("gateway", settings.enroll_token)  # (pdserve/shared/identity.py)
        bus = await Bus.connect(settings.nats_url, name="gateway", me=enrolled)
        state = State.for_service(settings, await bus.enroll_redis(enrolled, settings.redis_url) if enrolled else "")
        # (a start of its own: a restarted gateway's requests are the supervisors' to end, not its)
        name = identity.instance_id("gateway", settings.enroll_token, settings.gateway_id, "gateway")
        me = WorkerInfo(worker_id=f"{name}_{uuid.uuid4().hex[:8]}", role="gateway")
        app.state.gateway = build_gateway(settings, keys, bus, state, model_config, tokenizer, me.worker_id)
        stop = asyncio.Event()
        tasks = background(app.state.gateway, me, stop)
        serving()  # /ready may answer 200 (and what start built is out of the collector's reach)
        if keys.open:
            log.warning("no API keys configured (PD_API_KEYS): the API is open to anyone who can reach it")
        else:
            log.info("%d API keys configured", len(keys.keys))
        yield
        stop.set()
        await asyncio.gather(*tasks)
        try:
            await state.registry.deregister(me.worker_id)
        except Exception as e:  # noqa: BLE001 - Redis away: the lease lapses by itself
            log.warning("could not leave the registry: %s", e)
        await bus.close()
        await state.close()
        tracing.shutdown()
        tick.cancel()

    # FastAPI's own telemetry off: the request's span is RequestContext's (its trace continues the
    # client's and goes on through every service); FastAPI's would be a trace more per request,
    # and its metrics are Prometheus's here (pdserve/shared/metrics.py)
    app = FastAPI(title="pdserve", version="0.1.0", lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    errors.install(app)
    app.include_router(v1)
    app.include_router(tokens)
    app.include_router(ops)

    app.add_middleware(RequestContext, tracer=trace.get_tracer("pdserve.gateway"),
                       max_bytes=settings.max_request_bytes)
    return app


def background(gw: Gateway, me: WorkerInfo, stop: asyncio.Event) -> list[asyncio.Task]:
    """Until `stop`: the gateway's registry lease (it tells the routers' supervisors that someone still
    reads these requests' tokens), its requests' in-flight leases, and the readiness its /ready answers."""
    period_s = gw.settings.heartbeat_s
    return [asyncio.create_task(heartbeat(gw.state, lambda: me, period_s, stop)),
            asyncio.create_task(every(period_s, gw.in_flight.renew, stop, log, "renewing the in-flight leases")),
            asyncio.create_task(readiness.keep_judging(gw.state, gw.settings.require_prefill,
                                                       lambda: gw.bus.nc.is_connected, stop))]


async def load_model(settings: GatewaySettings) -> tuple[ModelConfig, Tokenizer]:
    """The model's architecture and tokenizer (with PD_CHAT_TEMPLATE when set), no weights; the
    grammar library loaded beside the start (PD_GRAMMAR_PRELOAD), not on a request."""
    model_config, tokenizer = await asyncio.to_thread(inspect, settings.model)
    if tokenizer is None:
        raise RuntimeError(f"model {settings.model!r} has no tokenizer; the gateway needs one")
    if settings.chat_template:
        tokenizer.chat_template = template_text(settings.chat_template)
    if settings.grammar_preload:
        threading.Thread(target=grammar.check, args=(grammar.Grammar("json_object"),), name="grammars",
                         daemon=True).start()
    return model_config, tokenizer


def build_gateway(settings: GatewaySettings, keys: KeyCheck, bus: Bus, state: State,
                  model_config: ModelConfig, tokenizer: Tokenizer, owner: str) -> Gateway:
    """What the request handlers share: the model's tokenizer and tool-call format, the relay,
    the key check, the rate limits and the per-key concurrency (`owner`: this gateway's id)."""
    fail_open = keys.open if settings.rate_limit_fail_open is None else settings.rate_limit_fail_open
    calls = tools.call_format(tokenizer.chat_template, tokenizer.template_takes_tools, settings.tool_call_parser)
    log.info("tool calls in the %s format", calls.name)
    return Gateway(settings, bus, state, tokenizer, model_config, calls,
                   Relay.for_gateway(settings, bus, state, owner), keys,
                   RateLimit(state, settings.rate_limit_per_s, settings.rate_limit_burst, fail_open=fail_open),
                   RateLimit(state, settings.token_rate_limit_per_s, settings.token_rate_limit_burst,
                             unit="tokens", fail_open=fail_open),
                   Concurrency(state, settings.max_concurrent_per_key, settings.lease_s, fail_open))


class Draining(uvicorn.Server):
    """uvicorn's server, whose SIGTERM / SIGINT also turns /ready to 503 (the probes' port stays open
    while the API's closes): an orchestrator takes the gateway out while its streams finish."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        PROBES.draining = True
        super().handle_exit(sig, frame)


def main(settings: GatewaySettings | None = None) -> None:
    """The gateway with `settings` (`pdserve gateway`: its flags), else from the environment."""
    settings = settings or GatewaySettings()
    setup_logging(settings, "gateway")
    config = uvicorn.Config(create_app(settings), host=settings.gateway_host, port=settings.gateway_port,
                            log_level=settings.log_level.lower(), timeout_graceful_shutdown=settings.drain_s,
                            timeout_keep_alive=settings.keep_alive_s,
                            limit_concurrency=settings.max_connections or None,
                            http=connections.protocol(settings.head_timeout_s, settings.send_deadline_s),
                            log_config=None)  # uvicorn's loggers go through ours (trace ids, JSON when asked)
    server = Draining(config)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)


if __name__ == "__main__":
    main()
