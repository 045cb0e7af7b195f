"""Trace sampling is OpenTelemetry's own setting (OTEL_TRACES_SAMPLER): the gateway decides,
every service after it follows the decision its message carries, and a request not recorded
keeps its trace id."""

from __future__ import annotations

import pytest

from pdserve.shared import tracing

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
NOT_SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@pytest.fixture
def tracer(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")   # no new trace recorded
    return tracing.provider("gateway", None).get_tracer("test")


def test_a_trace_not_recorded_keeps_its_id_and_says_so_downstream(tracer):
    with tracing.continued(tracer, "gateway.request", tracing.extract({})) as root:
        assert not root.is_recording()
        assert len(tracing.trace_id_hex(root).strip("0")) > 0   # x-trace-id all the same
        headers = tracing.inject()
    assert headers["traceparent"].split("-")[1] == tracing.trace_id_hex(root)
    assert not int(headers["traceparent"].split("-")[3], 16) & 1  # not sampled: the next service records nothing
    with tracing.continued(tracer, "router.route", tracing.extract(headers)) as span:
        assert not span.is_recording()


def test_a_recorded_callers_trace_is_recorded_on(tracer):
    with tracing.continued(tracer, "router.route", tracing.extract({"traceparent": SAMPLED})) as span:
        assert span.is_recording()
    with tracing.continued(tracer, "router.route", tracing.extract({"traceparent": NOT_SAMPLED})) as span:
        assert not span.is_recording()


def test_every_trace_is_recorded_by_default(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    tracer = tracing.provider("gateway", None).get_tracer("test")
    with tracing.continued(tracer, "gateway.request", tracing.extract({})) as root:
        assert root.is_recording()
