"""OpenTelemetry tracing: one trace per request across ingress, prefill, KV transfer, decode.

The W3C trace context travels inside the typed messages (``trace_carrier``); each process
continues the trace with ``span(...)``. The exporter (otlp | console | none) comes from
``ObservabilityConfig``; with ``none`` the OpenTelemetry API's no-op tracer is used and
spans cost nearly nothing. ``setup_tracing`` installs the provider once per process.
Only the ingress's root span (``"{operation} {model}"``, kind SERVER) carries the GenAI
semantic conventions (``gen_ai.*``: provider, request sampling, response id/model, token
usage, ``error.type``), so GenAI-aware backends count each request's tokens once. Internal
spans are ``pdserve.<stage>`` (``pdserve.decode``, ``pdserve.prefill``,
``pdserve.kv_transfer``...) with ``pdserve.*`` attributes only. An incoming W3C
``traceparent`` (HTTP header, gRPC metadata) becomes the root span's parent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve.deployments.config import ObservabilityConfig

_PROPAGATOR = TraceContextTextMapPropagator()
_LOCK = threading.Lock()
_INSTALLED: ObservabilityConfig | None = None
TRACER_NAME = "pdserve"

# GenAI semantic-convention attribute names: the root span only.
GENAI_OPERATION = "gen_ai.operation.name"
GENAI_PROVIDER = "gen_ai.provider.name"
GENAI_REQUEST_MODEL = "gen_ai.request.model"
GENAI_RESPONSE_ID = "gen_ai.response.id"
GENAI_RESPONSE_MODEL = "gen_ai.response.model"
GENAI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GENAI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GENAI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ERROR_TYPE = "error.type"
PROVIDER = "pdserve"

# Attributes of the internal spans (pdserve's own namespace, never gen_ai.*).
MODEL = "pdserve.model"
REQUEST_MAX_TOKENS = "pdserve.request.max_tokens"
REQUEST_TEMPERATURE = "pdserve.request.temperature"
USAGE_INPUT_TOKENS = "pdserve.prompt_tokens"
USAGE_OUTPUT_TOKENS = "pdserve.output_tokens"
RESPONSE_FINISH_REASONS = "pdserve.finish_reasons"


def setup_tracing(config: ObservabilityConfig) -> None:
    """Install the process-wide tracer provider for ``config`` (idempotent)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED is not None or config.tracing_exporter == "none":
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )

        provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
        if config.tracing_exporter == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = (
                OTLPSpanExporter(endpoint=config.otlp_endpoint)
                if config.otlp_endpoint
                else OTLPSpanExporter()
            )
            provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _INSTALLED = config


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject(span_context: otel_context.Context | None = None) -> dict[str, str]:
    """The W3C carrier (traceparent, tracestate) of the current or given context."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=span_context)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> otel_context.Context:
    return _PROPAGATOR.extract(dict(carrier or {}))


@contextmanager
def span(
    operation: str,
    model: str,
    *,
    carrier: Mapping[str, str] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Span]:
    """An internal span ``pdserve.{operation}``, child of ``carrier``'s context when given
    (else of the current context). Exceptions mark the span as an error and propagate."""
    parent = extract(carrier) if carrier else None
    attrs = {MODEL: model, **(attributes or {})}
    with tracer().start_as_current_span(
        f"pdserve.{operation}",
        context=parent,
        kind=kind,
        attributes=attrs,
        record_exception=True,
        set_status_on_exception=False,
    ) as current:
        try:
            yield current
        except Exception as err:
            current.set_status(Status(StatusCode.ERROR, type(err).__name__))
            raise


def record_span(
    operation: str,
    model: str,
    *,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """A finished child span of the current span for work timed elsewhere (e.g. a KV
    transfer that ran on another thread, overlapping the prefill compute)."""
    attrs = {MODEL: model, **(attributes or {})}
    done = tracer().start_span(f"pdserve.{operation}", start_time=start_ns, attributes=attrs)
    done.end(end_time=end_ns)
