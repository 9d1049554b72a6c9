"""Per-request telemetry at the ingress: the root trace span and the ingress-side metrics.

``IngressTelemetry.begin`` opens the request's root span (``"{operation} {model}"``, kind
SERVER; a child of the client's ``traceparent`` when it sent one) and gives the W3C
carrier that travels in ``GenerateRequest.trace_carrier``;
``RequestTelemetry.finish`` closes it once with the usage and finish reason and records
TTFT, TPOT, end-to-end latency and token counts as the client saw them (role "ingress").
The span is started detached (not made current) because a streamed response is finished
by another asyncio task than the one that began it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from pdserve.deployments import tracing
from pdserve.deployments.choices import Choices
from pdserve.deployments.metrics import ServingMetrics

if TYPE_CHECKING:
    from pdserve.deployments.decode_stream import DecodeStream

_W3C_KEYS = ("traceparent", "tracestate")


def _error_type(error: BaseException) -> str:
    """``error.type``: the HTTP status for a client-visible failure, else the class name."""
    status = getattr(error, "status_code", None)
    return str(status) if isinstance(status, int) else type(error).__qualname__


class RequestTelemetry:
    """The root span and timings of one request; ``finish`` is idempotent."""

    def __init__(self, metrics: ServingMetrics, span: trace.Span) -> None:
        self._metrics = metrics
        self._span = span
        self._start = time.monotonic()
        self._done = False
        self.carrier = tracing.inject(trace.set_span_in_context(span))

    def finish(self, stream: DecodeStream | Choices | None, error: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        now = time.monotonic()
        span = self._span
        if stream is not None:
            usage = stream.usage()
            if isinstance(stream, Choices):  # n > 1: one root span for every choice
                response_id, reasons = stream.request_id, stream.finish_reasons
            else:
                response_id, reasons = stream.request.request_id, [stream.finish_reason]
            span.set_attribute(tracing.GENAI_RESPONSE_ID, response_id)
            span.set_attribute(tracing.GENAI_INPUT_TOKENS, usage.prompt_tokens)
            span.set_attribute(tracing.GENAI_OUTPUT_TOKENS, usage.completion_tokens)
            if any(reasons):
                span.set_attribute(tracing.GENAI_FINISH_REASONS, [r or "" for r in reasons])
            self._record_metrics(stream, now, ok=error is None)
        if error is not None:
            span.set_attribute(tracing.ERROR_TYPE, _error_type(error))
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()

    def _record_metrics(self, stream: DecodeStream | Choices, now: float, *, ok: bool) -> None:
        m = self._metrics
        m.prompt_tokens.inc(stream.num_prompt_tokens)
        if stream.num_output_tokens:
            m.generation_tokens.inc(stream.num_output_tokens)
        first = stream.first_token_time
        if first is not None:
            m.time_to_first_token.observe(first - self._start)
            if ok and stream.num_output_tokens > 1:
                m.time_per_output_token.observe((now - first) / (stream.num_output_tokens - 1))
        if ok:
            m.e2e_latency.observe(now - self._start)


class IngressTelemetry:
    """Opens root spans and owns the ingress's metrics."""

    def __init__(
        self, model_name: str, metrics: ServingMetrics, tracer: trace.Tracer | None = None
    ) -> None:
        self.model_name = model_name
        self.metrics = metrics
        self._tracer = tracer  # None = the process-wide pdserve tracer (tracing.setup_tracing)

    def begin(
        self,
        operation: str,
        request_id: str,
        *,
        sampling: Mapping[str, Any] | None = None,
        parent: Mapping[str, str] | None = None,
    ) -> RequestTelemetry:
        """Open the root span. ``sampling``: the request's parameters as sent (None values
        dropped), recorded as ``gen_ai.request.<name>``; ``parent``: the incoming headers or
        metadata whose ``traceparent``/``tracestate`` the span continues."""
        attributes: dict[str, Any] = {
            tracing.GENAI_OPERATION: operation,
            tracing.GENAI_PROVIDER: tracing.PROVIDER,
            tracing.GENAI_REQUEST_MODEL: self.model_name,
            tracing.GENAI_RESPONSE_MODEL: self.model_name,
            "pdserve.request_id": request_id,
        }
        for name, value in (sampling or {}).items():
            if value is not None:
                attributes[f"gen_ai.request.{name}"] = value
        context = None
        if parent is not None:
            headers = {k.lower(): v for k, v in parent.items() if k.lower() in _W3C_KEYS}
            context = tracing.extract(headers) if headers else None
        tracer = self._tracer or tracing.tracer()
        span = tracer.start_span(
            f"{operation} {self.model_name}",
            context=context,
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        return RequestTelemetry(self.metrics, span)

    @classmethod
    def disabled(cls, model_name: str) -> IngressTelemetry:
        """No metrics; spans go to whatever tracer provider is installed (no-op by default)."""
        return cls(
            model_name,
            ServingMetrics(model_name=model_name, role="ingress", replica="", enabled=False),
        )
