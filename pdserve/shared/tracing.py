"""OpenTelemetry: one tracer provider per process, W3C trace context in message headers.

Spans are exported over OTLP/HTTP when an endpoint is configured (the standard
OTEL_EXPORTER_OTLP_ENDPOINT, e.g. Jaeger's http://localhost:4318); otherwise they are
created and dropped, so the code path is the same either way. Which traces are recorded is
OpenTelemetry's standard setting, OTEL_TRACES_SAMPLER (and _ARG; default: all): with
`parentbased_traceidratio` and 0.1 the gateway records one request in ten and every other
service follows the decision the trace context carries, so a trace is whole or absent. A
request not recorded still has its trace id (`x-trace-id`, log lines). The context carries W3C
`baggage` on with the trace (OpenTelemetry's default propagators); the entries named in
PD_TRACE_BAGGAGE_KEYS become attributes of every span (a client's entries are not all copied:
their keys and values are the client's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.processor.baggage import BaggageSpanProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_provider: TracerProvider | None = None


def setup(service: str, otlp_endpoint: str | None, baggage_keys: str = "") -> trace.Tracer:
    """This process's tracer (`provider`, made the global one)."""
    global _provider
    _provider = provider(service, otlp_endpoint, baggage_keys)
    trace.set_tracer_provider(_provider)
    return trace.get_tracer(f"pdserve.{service}")


def provider(service: str, otlp_endpoint: str | None, baggage_keys: str = "") -> TracerProvider:
    """The tracer provider of a service: the sampler from OTEL_TRACES_SAMPLER (the SDK reads
    it), the baggage entries named in `baggage_keys` (separated by commas) onto every span,
    spans exported in batches to `otlp_endpoint` when given."""
    made = TracerProvider(resource=Resource.create({"service.name": f"pdserve-{service}"}))
    keys = {k.strip() for k in baggage_keys.split(",") if k.strip()}
    if keys:
        made.add_span_processor(BaggageSpanProcessor(keys.__contains__))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")
        made.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    return made


def shutdown() -> None:
    """Flush spans still in the exporter's queue."""
    if _provider is not None:
        _provider.shutdown()


def inject(ctx: context.Context | None = None) -> dict[str, str]:
    """The current (or given) trace context as W3C headers."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(headers: dict[str, str] | None) -> context.Context:
    return propagate.extract(headers or {})


@contextmanager
def continued(tracer: trace.Tracer, name: str, ctx: context.Context, **kwargs: Any) -> Iterator[trace.Span]:
    """A span continuing `ctx` (a caller's or a message's context), made current with the whole
    of `ctx`: its baggage goes on with the trace (`start_as_current_span(context=ctx)` alone
    makes current the span only)."""
    token = context.attach(ctx)
    try:
        with tracer.start_as_current_span(name, **kwargs) as span:
            yield span
    finally:
        context.detach(token)


def trace_id_hex(span: trace.Span) -> str:
    return format(span.get_span_context().trace_id, "032x")
