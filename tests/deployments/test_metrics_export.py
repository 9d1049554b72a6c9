"""pdserve's metrics are ones Ray's metrics agent exports, and one request makes one trace
across the ingress, decode, prefill and the KV transfer, carried only by the W3C context
inside the messages (no Ray here: the prefill call runs in a fresh context, as in another
process). The same things on a real cluster: tests/cluster/test_run_e2e.py."""

from __future__ import annotations

import asyncio
import contextvars
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pdserve.deployments import tracing
from pdserve.deployments.config import AppConfig
from pdserve.deployments.messages import GenerateRequest, PrefillRequest, SamplingOptions
from pdserve.deployments.metrics import ServingMetrics, exported_name

# OpenTelemetry's instrument-name rule (Ray 2.60 records through OpenTelemetry) and
# Prometheus's metric-name rule without the ':' it reserves for recording rules.
OTEL_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-/]{0,254}$")
PROMETHEUS_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def test_every_metric_name_survives_ray_export() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Ray warns (and drops the metric) on bad names
        metrics = ServingMetrics(model_name="m", role="decode", replica="r", enabled=True)
    assert len(metrics.kinds) == 26
    for name in metrics.kinds:
        assert OTEL_NAME.match(name) and PROMETHEUS_NAME.match(name), name
        assert name.startswith("pdserve_")
    assert metrics.kinds["pdserve_time_to_first_token_seconds"] == "histogram"
    # Admission control: the prediction a shed decision rests on, and its error.
    assert metrics.kinds["pdserve_predicted_time_to_first_token_seconds"] == "histogram"
    assert metrics.kinds["pdserve_ttft_prediction_error_seconds"] == "histogram"
    # Requests admitted although predicted past their TTFT threshold (an idle replica's long
    # prompt, a class that queues, a cold pool's prior).
    assert metrics.kinds["pdserve_requests_admitted_past_slo"] == "counter"
    # The ingress's adaptive bound on its open streams, and what it holds open.
    assert metrics.kinds["pdserve_stream_limit"] == "gauge"
    assert metrics.kinds["pdserve_open_streams"] == "gauge"
    # Each engine replica's weight and KV cache dtypes, as labels of a constant gauge.
    assert metrics.kinds["pdserve_engine_dtypes"] == "gauge"
    assert exported_name("pdserve_prompt_tokens", "counter") == "ray_pdserve_prompt_tokens_total"
    assert (
        exported_name("pdserve_kv_cache_usage_perc", "gauge") == "ray_pdserve_kv_cache_usage_perc"
    )


def test_recording_zero_or_a_decision_does_not_raise() -> None:
    """Ray's Counter raises on inc(0); a request that produced no tokens must still finish."""
    metrics = ServingMetrics(model_name="m", role="ingress", replica="", enabled=True)
    metrics.generation_tokens.inc(0)
    metrics.prompt_tokens.inc(5)
    metrics.record_decision("remote")
    metrics.record_load(running=0, waiting=0, kv_usage=0.0)
    metrics.e2e_latency.observe(0.2)

    class Engine:
        def dtypes(self) -> tuple[str, str]:
            return "bfloat16", "fp8_e4m3"

    metrics.record_dtypes(Engine())
    metrics.record_dtypes(object())  # a fake engine without dtypes(): nothing recorded


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """An in-memory exporter on the process's SDK provider (installed here if none is yet;
    OpenTelemetry lets a process set its provider only once)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


class OtherProcessPrefill:
    """Calls a ``PrefillServer`` the way Serve would from another process: the request is
    serialized and the call starts from an empty context, so only the carrier links it."""

    def __init__(self, server: Any) -> None:
        self.server = server

    async def prefill(self, request: PrefillRequest) -> Any:
        wire = PrefillRequest.model_validate_json(request.model_dump_json())
        task = asyncio.create_task(self.server.prefill(wire), context=contextvars.Context())
        return await task


@pytest.fixture(scope="module")
def servers() -> Iterator[Any]:
    from pdserve.deployments.decode_server import DecodeServer
    from pdserve.deployments.prefill_server import PrefillServer

    cfg = AppConfig.from_dict(
        {
            "model": {"test_model": "tiny", "dtype": "float32", "device": "cpu"},
            "prefill": {"engine": {"num_kv_blocks": 32, "max_num_seqs": 4}},
            "decode": {"engine": {"num_kv_blocks": 32, "max_num_seqs": 4}},
            "slo": {"ttft_ms": 60_000},
            "policy": {"mode": "always_remote"},
            "observability": {"metrics_enabled": False},
        }
    )
    model_dir = cfg.model.resolve_path()
    prefill = PrefillServer(cfg, model_dir)
    decode = DecodeServer(cfg, model_dir, prefill=OtherProcessPrefill(prefill))
    yield decode
    decode.shutdown()
    prefill.shutdown()


def test_one_trace_spans_ingress_decode_prefill_and_kv_transfer(
    spans: InMemorySpanExporter, servers: Any
) -> None:
    decode = servers
    model = decode.model_name
    spans.clear()
    root = tracing.tracer().start_span(f"text_completion {model}", kind=SpanKind.SERVER)
    carrier = tracing.inject(trace.set_span_in_context(root))
    req = GenerateRequest(
        request_id="traced-1",
        prompt_token_ids=[(i * 7) % 500 + 20 for i in range(40)],
        sampling=SamplingOptions(max_tokens=3, temperature=0.0, ignore_eos=True),
        trace_carrier=carrier,
    )

    async def run() -> list[Any]:
        # A fresh context: the decode side, too, only has the carrier.
        task = asyncio.create_task(_collect(decode, req), context=contextvars.Context())
        return await task

    chunks = asyncio.run(run())
    root.end()
    assert chunks[0].prefill_location == "remote" and chunks[-1].finish_reason == "length"
    finished = {s.name.removeprefix("pdserve."): s for s in spans.get_finished_spans()}
    assert {f"text_completion {model}", "decode", "prefill_remote", "prefill", "kv_transfer"} <= (
        set(finished)
    )
    trace_id = root.get_span_context().trace_id
    assert {s.context.trace_id for s in finished.values()} == {trace_id}
    assert finished["decode"].parent.span_id == root.get_span_context().span_id
    assert finished["prefill"].parent.span_id == finished["prefill_remote"].context.span_id
    assert finished["kv_transfer"].attributes["pdserve.kv_transfer.bytes"] > 0
    assert finished["prefill"].attributes["pdserve.kv_target.address"].startswith("127.0.0.1:")
    assert finished["decode"].attributes["pdserve.output_tokens"] == 3
    assert finished["decode"].attributes["pdserve.prefill.location"] == "remote"
    # Token usage is the root span's alone: no internal span carries gen_ai.* attributes.
    internal = [s for name, s in finished.items() if not name.startswith("text_completion")]
    assert not [k for s in internal for k in s.attributes if k.startswith("gen_ai.")]


async def _collect(decode: Any, req: GenerateRequest) -> list[Any]:
    return [chunk async for chunk in decode.generate(req)]
