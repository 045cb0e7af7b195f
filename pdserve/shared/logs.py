"""Logging for every service: each record carries the trace id and request id of the span it
was logged under (so a log line leads to its trace), as text by default or one JSON object
per line (`PD_LOG_FORMAT=json`) for a log pipeline."""

from __future__ import annotations

import json
import logging

from opentelemetry import trace


class TraceContext(logging.Filter):
    """Adds `trace_id` and `request_id` (empty outside a request) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        span = trace.get_current_span()
        ctx = span.get_span_context()
        record.trace_id = format(ctx.trace_id, "032x") if ctx.is_valid else ""
        attributes = getattr(span, "attributes", None) or {}
        record.request_id = str(attributes.get("request_id", ""))
        return True


class TextFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        trace_id = getattr(record, "trace_id", "")
        if trace_id:
            line += f" [trace_id={trace_id} request_id={getattr(record, 'request_id', '')}]"
        return line


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "service": self.service,
                 "logger": record.name, "message": record.getMessage(),
                 "trace_id": getattr(record, "trace_id", ""), "request_id": getattr(record, "request_id", "")}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup(level: str, service: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(TraceContext())
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
