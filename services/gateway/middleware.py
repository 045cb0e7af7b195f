"""Every HTTP request: a request id, the root span of its trace, both returned as headers
(`x-request-id`, `x-trace-id`) on every response, errors included; and the body size limit."""

from __future__ import annotations

import time
import uuid

from fastapi.responses import JSONResponse
from opentelemetry import trace

from services.gateway import errors
from shared import tracing


class RequestContext:
    """Plain ASGI (no per-request task, unlike Starlette's BaseHTTPMiddleware)."""

    def __init__(self, app, tracer: trace.Tracer, max_bytes: int):
        self.app, self.tracer, self.max_bytes = app, tracer, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/metrics":  # scrapes: no trace each few seconds
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {}).update(request_id=request_id, arrived=time.monotonic())
        name = f"{scope['method']} {scope['path']}"
        with self.tracer.start_as_current_span("gateway.request", kind=trace.SpanKind.SERVER, attributes={
                "request_id": request_id, "http.route": name}) as span:
            ids = [(b"x-request-id", request_id.encode()), (b"x-trace-id", tracing.trace_id_hex(span).encode())]

            async def send_with_ids(message):
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", []), *ids]
                    span.set_attribute("http.status_code", message["status"])
                await send(message)

            size = dict(scope["headers"]).get(b"content-length", b"")
            if size.isdigit() and int(size) > self.max_bytes:
                too_big = JSONResponse(errors.body(413, f"Request body over {self.max_bytes} bytes."), status_code=413)
                return await too_big(scope, receive, send_with_ids)
            await self.app(scope, receive, send_with_ids)
