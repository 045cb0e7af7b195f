"""An OTLP/HTTP trace receiver: services export to it; tests and benchmarks read the spans, in
process or (`python -m pdserve.shared.tools.otlp_sink`, make compose-check's stand-in for Jaeger) as JSON
from GET /spans?trace_id=<hex>."""

from __future__ import annotations

import dataclasses
import gzip
import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    start_ns: int = 0
    end_ns: int = 0
    events: tuple = ()          # (name, attributes) of each span event, in order
    trace_state: str = ""       # W3C tracestate, as the trace's caller sent it

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind is None:  # an attribute with no value
        return None
    return [_value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)


def _attributes(kvs: Iterable[KeyValue]) -> dict:
    return {a.key: _value(a.value) for a in kvs}


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # connections kept open, as a collector's are

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                data = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    data = gzip.decompress(data)
                receiver._ingest(ExportTraceServiceRequest.FromString(data))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                trace_id = parse_qs(urlsplit(self.path).query).get("trace_id", [""])[0]
                body = json.dumps([dataclasses.asdict(s) for s in receiver.trace(trace_id)], default=str).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return None

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _ingest(self, req: ExportTraceServiceRequest) -> None:
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    events = tuple((e.name, _attributes(e.attributes)) for e in s.events)
                    span = Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                _attributes(s.attributes), s.start_time_unix_nano, s.end_time_unix_nano, events,
                                s.trace_state)
                    with self._lock:
                        self.spans.append(span)

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: Iterable[str], timeout_s: float = 20) -> list[Span]:
        """The trace's spans once every name in `names` is among them (exporters batch), or
        whatever arrived by the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not set(names) <= {s.name for s in self.trace(trace_id)}:
            time.sleep(0.2)
        return self.trace(trace_id)

    def attributes(self, trace_id: str, names: Iterable[str], timeout_s: float = 20) -> dict[str, dict]:
        """Span name → attributes, after `wait_for`."""
        return {s.name: s.attributes for s in self.wait_for(trace_id, names, timeout_s)}

    def close(self) -> None:
        self._server.shutdown()


if __name__ == "__main__":   # on every address, OTLP/HTTP's port, until SIGTERM (a container's stop)
    import signal

    receiver = OtlpReceiver("0.0.0.0", 4318)
    print(f"receiving traces on {receiver.url}", flush=True)
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)   # (as PID 1 a signal left at its default is ignored)
    signal.sigwait(stops)
