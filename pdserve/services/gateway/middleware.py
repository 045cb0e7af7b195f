"""Every HTTP request: a request id of the server's (ids.py), the root span of its trace
(continuing the client's `traceparent`, `tracestate` and `baggage`), both returned as headers
(`x-request-id`, `x-trace-id`) on every response, errors included, with the client's own id
echoed (`x-client-request-id`); the body size limit, counted as the bytes arrive (a chunked body has no
Content-Length); and the last word on a failure no handler answered: a 500 in OpenAI's error
shape, with the ids, its traceback in the log."""

from __future__ import annotations

import logging
import time

from fastapi.responses import JSONResponse
from opentelemetry import trace
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.services.gateway import errors, ids
from pdserve.shared import tracing

log = logging.getLogger("gateway")


class BodyTooLarge(StarletteHTTPException):
    """Raised from the body's reading (an HTTP error, so FastAPI's body parser passes it on as
    itself, answered by errors.py's handler)."""

    def __init__(self, limit: int):
        super().__init__(413, f"Request body over {limit} bytes.")


class RequestContext:
    """Plain ASGI (no per-request task, unlike Starlette's BaseHTTPMiddleware)."""

    def __init__(self, app: ASGIApp, tracer: trace.Tracer, max_bytes: int):
        self.app, self.tracer, self.max_bytes = app, tracer, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        client, request_id = ids.client_id(headers), ids.new()
        state = scope.setdefault("state", {})
        state.update(request_id=request_id, arrived=time.monotonic())
        name = f"{scope['method']} {scope['path']}"
        with tracing.continued(self.tracer, "gateway.request", tracing.extract(headers), kind=trace.SpanKind.SERVER,
                               attributes={"request_id": request_id, "http.route": name,
                                           **ids.attributes(client)}) as span:
            started = False

            async def send_with_ids(message: Message) -> None:
                nonlocal started
                if message["type"] == "http.response.start":
                    started = True
                    message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode()),
                                          (b"x-trace-id", tracing.trace_id_hex(span).encode()), *ids.echoed(client)]
                    span.set_attribute("http.status_code", message["status"])
                await send(message)

            received = 0

            async def counted() -> Message:
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > self.max_bytes:
                        raise BodyTooLarge(self.max_bytes)
                return message

            size = headers.get("content-length", "")
            if len(size) > 20 or (size.isdigit() and int(size) > self.max_bytes):
                return await self._too_large(scope, receive, send_with_ids)
            if client is not None and not client.valid:
                return await self._refused_id(scope, receive, send_with_ids, client.header)
            try:
                await self.app(scope, counted, send_with_ids)
            except Exception as e:  # noqa: BLE001 - the catch-all: no request gets a bare 500
                log.exception("%s: %s failed", request_id, name)
                span.record_exception(e)
                if not started:
                    failed = JSONResponse(errors.body(500, f"The server failed on this request ({type(e).__name__}); "
                                                           f"its id is {request_id}."), status_code=500)
                    await failed(scope, receive, send_with_ids)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        too_big = JSONResponse(errors.body(413, BodyTooLarge(self.max_bytes).detail), status_code=413)
        await too_big(scope, receive, send)

    async def _refused_id(self, scope: Scope, receive: Receive, send: Send, header: str) -> None:
        refused = JSONResponse(errors.body(400, f"The {header} header must be {ids.CLIENT_ID_RULE}.",
                                           param=header), status_code=400)
        await refused(scope, receive, send)
