"""Log records carry the trace id and request id of the span they were logged under, in
text and in JSON lines."""

from __future__ import annotations

import json
import logging

from opentelemetry.sdk.trace import TracerProvider

from pdserve.shared.logs import JsonFormatter, TextFormatter, TraceContext


def _record(msg: str) -> logging.LogRecord:
    record = logging.LogRecord("router", logging.WARNING, __file__, 1, msg, (), None)
    TraceContext().filter(record)
    return record


def test_records_logged_in_a_span_carry_its_trace_and_request_ids():
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("router.route", attributes={"request_id": "r-42"}) as span:
        record = _record("admit refused")
    trace_id = format(span.get_span_context().trace_id, "032x")
    entry = json.loads(JsonFormatter("router").format(record))
    assert entry["trace_id"] == trace_id and entry["request_id"] == "r-42"
    assert entry["message"] == "admit refused" and entry["service"] == "router" and entry["level"] == "WARNING"
    assert TextFormatter("router").format(record).endswith(f"admit refused [trace_id={trace_id} request_id=r-42]")
    outside = _record("ready")   # no span: no ids, and the text line has no empty brackets
    assert json.loads(JsonFormatter("router").format(outside))["trace_id"] == ""
    assert TextFormatter("router").format(outside).endswith("router: ready")
