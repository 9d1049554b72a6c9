"""Tracing carries one trace across processes; metrics are no-ops when disabled."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.deployments import tracing
from pdserve.deployments.metrics import ServingMetrics


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """An in-memory exporter on the process's SDK provider (installed here if none is yet:
    OpenTelemetry lets a process set its provider only once, and other test modules add
    their exporters to the same one)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def test_carrier_continues_one_trace_with_pdserve_names(spans: InMemorySpanExporter) -> None:
    spans.clear()
    with tracing.span("ingress", "tiny", attributes={tracing.REQUEST_MAX_TOKENS: 8}):
        carrier = tracing.inject()
    assert "traceparent" in carrier
    # Another process: only the carrier crosses the boundary.
    with tracing.span("prefill", "tiny", carrier=carrier):
        pass
    with pytest.raises(RuntimeError), tracing.span("decode", "tiny", carrier=carrier):
        raise RuntimeError("replica died")
    root, prefill, decode = sorted(spans.get_finished_spans(), key=lambda s: s.start_time)
    names = [root.name, prefill.name, decode.name]
    assert names == ["pdserve.ingress", "pdserve.prefill", "pdserve.decode"]
    assert {s.context.trace_id for s in (root, prefill, decode)} == {root.context.trace_id}
    assert prefill.parent.span_id == root.context.span_id
    # Internal spans never use the GenAI namespace (backends would count their tokens).
    assert dict(root.attributes) == {"pdserve.model": "tiny", "pdserve.request.max_tokens": 8}
    assert decode.status.status_code == trace.StatusCode.ERROR


def test_without_carrier_a_span_starts_a_new_trace(spans: InMemorySpanExporter) -> None:
    spans.clear()
    with tracing.span("decode", "m"):
        pass
    with tracing.span("decode", "m", carrier={}):
        pass
    a, b = spans.get_finished_spans()
    assert a.context.trace_id != b.context.trace_id and a.parent is None


def test_disabled_metrics_accept_every_call() -> None:
    m = ServingMetrics(model_name="m", role="decode", replica="r", enabled=False)
    m.time_to_first_token.observe(0.1)
    m.kv_transfer_bytes.inc(100)
    m.record_decision("remote")
    m.record_load(running=1, waiting=0, kv_usage=0.5)


def test_work_timed_elsewhere_becomes_a_child_span(spans: InMemorySpanExporter) -> None:
    spans.clear()
    with tracing.span("decode", "m") as parent:
        tracing.record_span(
            "kv_transfer", "m", start_ns=1_000, end_ns=5_000, attributes={"bytes": 64}
        )
    transfer = next(s for s in spans.get_finished_spans() if s.name == "pdserve.kv_transfer")
    assert (transfer.start_time, transfer.end_time) == (1_000, 5_000)
    assert transfer.parent.span_id == parent.get_span_context().span_id
    assert transfer.attributes["bytes"] == 64
