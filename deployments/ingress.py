"""The front door: ``OpenAIIngress``, a Serve deployment serving the OpenAI HTTP API (FastAPI)
and pdserve's gRPC API (through Serve's gRPC proxy) on top of the decode pool.

It validates and tokenizes requests, sends a ``GenerateRequest`` to the decode deployment
and streams the ``GenerateChunk``s back. It never runs a model and never reaches the
prefill pool directly. Routes: POST /v1/completions, POST /v1/chat/completions,
GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize (vLLM's shapes),
GET /health (503 while a deployment in ``ready_deployments`` has no running replica),
GET /ready (the same, with the reason as JSON), GET /version, GET /metrics (Prometheus text
of the ingress's own registry). Every route first passes ``APIGuard`` (API keys, rate
limits; /health and /metrics can stay open) and bodies past ``api.max_body_bytes`` get 413.
The request header ``x-pdserve-priority`` (gRPC: metadata of that name; the older
``x-pdserve-slo-class`` is read too) is ``interactive`` (default) or ``batch``: admission
control on the decode replica sheds batch first and lets it queue longer. With shedding on,
the ingress itself answers 429 at its door past its adaptive bound on open streams
(``admission.StreamLimit``), and, with ``policy.admission_timeout``, for a request the
decode pool did not admit (or shed) within half of ``policy.reject_within_ms``
(``admission.admission_ack_timeout_s``).
Serve bounds the ingress (``app.ingress_bounds``): past what the decode pool admits, Serve's
proxy answers 429 itself; a full Serve queue for the decode pool is a 429 here too.
gRPC: ``pdserve.v1.PDServe.Generate`` (server streaming) and ``.Complete`` (unary) from
``deployments/grpc/pdserve.proto``, and ``grpc.health.v1.Health/Check``, through Serve's
gRPC proxy.
"""

import asyncio
import contextvars
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.deployments.admission import (
    MIN_DRAIN_S,
    ProxyLag,
    ShedHint,
    StreamLimit,
    admission_ack_timeout_s,
    ingress_overloaded,
    stream_lag_budget_s,
)
from pdserve.deployments.api_guard import APIGuard, read_body
from pdserve.deployments.config import APIConfig, ObservabilityConfig
from pdserve.deployments.decode_stream import DecodeStream, error_from_info
from pdserve.deployments.grpc import pdserve_pb2 as pb2
from pdserve.deployments.ingress_telemetry import IngressTelemetry
from pdserve.deployments.load import Ema, LoopLag
from pdserve.deployments.messages import (
    ErrorInfo,
    GenerateChunk,
    GenerateRequest,
    SLOClass,
    TokenLogprob,
)
from pdserve.deployments.metrics import APIMetrics, ServingMetrics
from pdserve.deployments.migration import MigratingStream, MigrationMetrics
from pdserve.deployments.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    ignored_fields_header,
    parse_json_body,
    validate_request,
)
from pdserve.deployments.openai_serving import ModelInfo, OpenAIServing, RequestLimits
from pdserve.deployments.openapi_schema import (
    CHAT_SCHEMA,
    COMPLETION_SCHEMA,
    DETOKENIZE_SCHEMA,
    TOKENIZE_SCHEMA,
    install_openapi,
    request_body,
)
from pdserve.deployments.sampling_defaults import SamplingDefaults
from pdserve.deployments.tracing import setup_tracing
from pdserve.engine.loader import load_model_config, load_tokenizer

logger = logging.getLogger(__name__)

SLO_CLASS_HEADER = "x-pdserve-slo-class"
PRIORITY_HEADER = "x-pdserve-priority"
READY_CACHE_S = 1.0
RETRY_AFTER_S = 1.0
TURNED_AWAY_REPORT_S = 1.0  # how often the door's capacity sheds are reported to the pool
TURNED_AWAY_TIMEOUT_S = 5.0

PDSERVE_VERSION = package_version("pdserve")

app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
install_openapi(app)


async def _json(body: dict[str, Any]) -> Response:
    return JSONResponse(body)


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers())


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, err: OpenAIError) -> JSONResponse:
    return error_response(err)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and wrong methods get the OpenAI error body too.
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return error_response(OpenAIError(str(err.detail), status_code=err.status_code, type=kind))


def _slo_class(headers: Any) -> SLOClass:
    """The request's priority class from its headers (or gRPC metadata as a mapping)."""
    name = PRIORITY_HEADER if headers.get(PRIORITY_HEADER) is not None else SLO_CLASS_HEADER
    value = headers.get(name)
    if value in (None, "", "interactive"):
        return "interactive"
    if value == "batch":
        return "batch"
    raise OpenAIError(
        f"header {name} must be 'interactive' or 'batch', got {value!r}",
        param=name,
        code="invalid_value",
    )


def _sse(events: AsyncIterator[str], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
    )


_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


class GRPCRequestError(RuntimeError):
    """Raised out of a gRPC method after the status code was set on the context."""


def _abort_grpc(grpc_context: Any, err: OpenAIError) -> None:
    # Serve keeps a code set on the context when the method then raises.
    if grpc_context is not None:
        grpc_context.set_code(_GRPC_CODES.get(err.status_code, grpc.StatusCode.INTERNAL))
        grpc_context.set_details(err.message)
    raise GRPCRequestError(err.message)


def _grpc_to_openai(
    proto: pb2.CompletionRequest, grpc_context: Any, *, stream: bool
) -> CompletionRequest | ChatCompletionRequest:
    """The proto request as the equivalent validated OpenAI request."""
    fields: dict[str, Any] = {
        "model": proto.model or None,
        "stream": stream,
        "ignore_eos": proto.ignore_eos,
        "min_tokens": proto.min_tokens,
    }
    if proto.stop:
        fields["stop"] = list(proto.stop)
    if proto.stop_token_ids:
        fields["stop_token_ids"] = list(proto.stop_token_ids)
    for name in ("temperature", "top_p", "top_k", "seed"):
        if proto.HasField(name):
            fields[name] = getattr(proto, name)
    try:
        given = [bool(proto.prompt), bool(proto.prompt_token_ids), bool(proto.messages)]
        if sum(given) != 1:
            raise OpenAIError(
                "set exactly one of prompt, prompt_token_ids and messages", param="prompt"
            )
        if proto.messages:
            fields["messages"] = [{"role": m.role, "content": m.content} for m in proto.messages]
            if proto.HasField("max_tokens"):
                fields["max_completion_tokens"] = proto.max_tokens
            if proto.HasField("logprobs"):
                fields["logprobs"] = True
                fields["top_logprobs"] = proto.logprobs
            return validate_request(ChatCompletionRequest, fields)
        fields["prompt"] = proto.prompt or list(proto.prompt_token_ids)
        if proto.HasField("max_tokens"):
            fields["max_tokens"] = proto.max_tokens
        if proto.HasField("logprobs"):
            fields["logprobs"] = proto.logprobs
        return validate_request(CompletionRequest, fields)
    except OpenAIError as err:
        _abort_grpc(grpc_context, err)
        raise  # unreachable: _abort_grpc raises


def _grpc_logprobs(logprobs: list[TokenLogprob] | None) -> list[pb2.TokenLogprob]:
    return [
        pb2.TokenLogprob(
            token_id=lp.token_id,
            token=lp.token,
            logprob=lp.logprob,
            top_logprobs=[
                pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob)
                for t in lp.top_logprobs
            ],
        )
        for lp in logprobs or []
    ]


def _metadata(grpc_context: Any) -> dict[str, str]:
    """The call's gRPC metadata (its W3C ``traceparent``, if any) as a mapping."""
    read = getattr(grpc_context, "invocation_metadata", None)
    if read is None:
        return {}
    return {k: v for k, v in (read() or ()) if isinstance(v, str)}


LATE_DECISION_TIMEOUT_S = 60.0


async def _drop_late(
    decision: asyncio.Future[GenerateChunk], chunks: AsyncIterator[GenerateChunk], response: Any
) -> None:
    """The rest of a call whose client got 429 before the decode pool decided: the decode
    replica drops it unanswered past its ``admit_by`` (its 429 chunk ends the stream);
    one admitted just in time (an ack or a token) is cancelled, as a client that went away
    would be; one with no answer within ``LATE_DECISION_TIMEOUT_S`` too."""
    try:
        first = await asyncio.wait_for(asyncio.shield(decision), LATE_DECISION_TIMEOUT_S)
        if first.error is not None:
            async for _ in chunks:  # the stream ends after its error chunk
                pass
            return
    except Exception as err:  # noqa: BLE001 - the client has its answer; only log
        logger.debug("late decision of a request already answered 429: %r", err)
    response.cancel()


async def _prepend(
    first: GenerateChunk, rest: AsyncIterator[GenerateChunk]
) -> AsyncIterator[GenerateChunk]:
    yield first
    async for chunk in rest:
        yield chunk


def pools_ready(app_status: Any, deployments: list[str]) -> tuple[bool, str]:
    """Whether every named deployment of the app (``serve.status()``'s application
    overview, None if the app is missing) has a running replica, and why not."""
    if app_status is None:
        return False, "application not found"
    missing = []
    for name in deployments:
        deployment = app_status.deployments.get(name)
        running = 0 if deployment is None else deployment.replica_states.get("RUNNING", 0)
        if running < 1:
            missing.append(name)
    if missing:
        return False, "no running replica: " + ", ".join(missing)
    return True, "all pools have a running replica"


def _grpc_usage(stream: DecodeStream) -> pb2.Usage:
    usage = stream.usage()
    return pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_tokens=usage.prompt_tokens_details.cached_tokens,
    )


class TurnedAway:
    """Requests turned away for lack of decode capacity (the pool's drain hint, or Serve's
    queue for the pool full) and not yet reported to the pool: its autoscaling policy
    counts them as demand (``DecodeServer.report_turned_away``). Sheds on the front door's
    own lag are not counted: more decode replicas would not fix them. Reported at most
    every ``period_s``, so a flood costs one call a second."""

    def __init__(self, period_s: float = TURNED_AWAY_REPORT_S) -> None:
        self.period_s = period_s
        self.pending = 0
        self._last: float | None = None

    def add(self, n: int = 1) -> None:
        self.pending += n

    def take(self, now: float) -> int:
        """The count to report now (0: nothing pending, or reported under ``period_s`` ago)."""
        if not self.pending or (self._last is not None and now - self._last < self.period_s):
            return 0
        n, self.pending, self._last = self.pending, 0, now
        return n


# The class comes last: @serve.ingress pickles the app (and so these methods) when the
# class is defined, capturing only the module globals that exist at that point.
@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024)
@serve.ingress(app)
class OpenAIIngress:
    """OpenAI HTTP + pdserve gRPC front door over the decode deployment.

    Args:
        decode: handle to the decode deployment (``DecodeServer.generate`` streams chunks).
        model_dir: local model directory; its tokenizer and chat template are used.
        model_name: id shown to clients; None = the directory's name.
        max_model_len: longest prompt + output in tokens; None = the model's context length.
        ready_deployments: deployments of this app that must each have a running replica
            for GET /ready to answer 200 (the prefill and decode pools); empty = always ready.
        observability: tracing exporter and metrics switch; None = defaults (no tracing).
        api: API keys, request size and rate limits; None = defaults (no keys).
        ttft_slo_ms: the TTFT objective; with it a request is shed (429) while this
            replica's own event loop and Serve's proxy in front of it (the wait for a
            request body) lag past a share of it (None = never).
        max_streams: with ``ttft_slo_ms``, bound the streams held open adaptively
            (``admission.StreamLimit``, up to this many; None = no bound of pdserve's own).
        limit_batch: whether that bound sheds batch requests too (False when batch queues).
        reject_within_ms: how fast a 429 should be answered (p99); the bound is cut while
            this replica's loop lags a sixth of it (``admission.stream_lag_budget_s``).
        admission_timeout: with ``ttft_slo_ms``, answer 429 here for a request the decode
            pool has not admitted (or shed) within half of ``reject_within_ms``
            (``admission.admission_ack_timeout_s``; ``policy.admission_timeout``).
    """

    def __init__(
        self,
        decode: DeploymentHandle,
        model_dir: str,
        model_name: str | None = None,
        max_model_len: int | None = None,
        ready_deployments: list[str] | None = None,
        observability: ObservabilityConfig | dict[str, Any] | None = None,
        api: APIConfig | dict[str, Any] | None = None,
        ttft_slo_ms: float | None = None,
        max_streams: int | None = None,
        limit_batch: bool = True,
        reject_within_ms: float = 100.0,
        admission_timeout: bool = False,
        max_migrations: int = 0,
    ) -> None:
        observability = ObservabilityConfig.model_validate(observability or {})
        self._api = APIConfig.model_validate(api or {})
        self._guard = APIGuard(self._api)
        setup_tracing(observability)
        self._decode = decode
        info = ModelInfo(
            name=model_name or Path(model_dir).name,
            max_model_len=max_model_len or load_model_config(model_dir).max_context,
            root=model_dir,
        )
        metrics = ServingMetrics(
            model_name=info.name,
            role="ingress",
            replica=serve.get_replica_context().replica_tag,
            enabled=observability.metrics_enabled,
        )
        limits = RequestLimits(
            max_prompt_tokens=self._api.max_prompt_tokens,
            max_messages=self._api.max_messages,
            max_stop_strings=self._api.max_stop_strings,
            chat_template=self._api.chat_template,
        )
        self.serving = OpenAIServing(
            load_tokenizer(model_dir),
            info,
            self._generate,
            IngressTelemetry(info.name, metrics),
            limits,
            SamplingDefaults.from_model_dir(model_dir),
        )
        self._api_metrics = APIMetrics(info.name)
        # Admission control runs on the decode replica (it knows its queue exactly); this
        # remembers the drain time of its last sheds so that a flood is answered 429 here,
        # at once, instead of queueing for a replica busy streaming (admission.ShedHint);
        # for at most half the TTFT SLO, then a replica is asked again (its drain time is a
        # prediction, and a pessimistic one would idle the engine).
        self._shed_hint = ShedHint(max_window_s=ttft_slo_ms / 2000.0 if ttft_slo_ms else None)
        self._serving_metrics = metrics
        self._max_migrations = max_migrations
        self._migration_metrics = MigrationMetrics(
            model_name=info.name,
            replica=serve.get_replica_context().replica_tag,
            enabled=observability.metrics_enabled,
        )
        self._loop_lag = LoopLag()
        self._proxy_lag = ProxyLag()
        self._ttft_slo_s = ttft_slo_ms / 1000.0 if ttft_slo_ms else None
        self._turned_away = TurnedAway()
        # The serving path's own bound: streams open here, by the TTFT observed on them
        # and the lag of this replica's loop (admission.StreamLimit).
        self._streams = (
            StreamLimit(
                self._ttft_slo_s,
                high=max_streams,
                lag_budget_s=stream_lag_budget_s(reject_within_ms / 1000.0),
            )
            if max_streams and self._ttft_slo_s is not None
            else None
        )
        self._limit_batch = limit_batch
        # With admission_timeout, a request whose admission decision does not come within
        # a share of reject_within_ms is answered 429 here (admission_ack_timeout_s).
        shedding = admission_timeout and self._ttft_slo_s is not None
        self._ack_within_s = reject_within_ms / 1000.0 if shedding else None
        self._num_open = 0
        self._stream_s = Ema()  # how long a stream stays open
        self._reports: set[asyncio.Task[None]] = set()
        self._late: set[asyncio.Task[None]] = set()  # calls answered 429, left to end
        self._ready_deployments = list(ready_deployments or [])
        self._ready_cache: tuple[float, bool, str] = (0.0, False, "")

    def _door(self, slo_class: SLOClass) -> tuple[str, float] | None:
        """(message, Retry-After) when a request of this class is to be shed before any
        work: the decode pool shed its class within its drain time, or the front door is
        the queue (this ingress's event loop, or Serve's proxy in front of it: the
        request waited there already, unseen by admission control). Recorded as shed."""
        self._loop_lag.ensure_running()
        now = time.monotonic()
        self._report_turned_away(now)
        loop_lag, proxy_lag = self._loop_lag.seconds, self._proxy_lag.seconds(now)
        wait_s = self._shed_hint.remaining_s(slo_class, now)
        reason = "drain_hint" if wait_s > 0 else ""
        if reason:
            self._turned_away.add()  # the pool is full: demand it did not see
        slo_s = self._ttft_slo_s
        if not reason and slo_s is not None:
            if ingress_overloaded(loop_lag, slo_class, slo_s):
                reason = "ingress_lag"
            elif ingress_overloaded(loop_lag, slo_class, slo_s, proxy_lag_s=proxy_lag):
                reason = "proxy_lag"
            wait_s = 2 * (loop_lag + proxy_lag)  # the lag in, and again out
        if not reason and (drain_s := self._stream_drain_s(slo_class)) is not None:
            reason, wait_s = "concurrency", drain_s
            self._turned_away.add()  # the pool, as far as this door can feed it, is full
        if not reason:
            return None
        self._serving_metrics.record_shed(reason, slo_class)
        message = (
            f"overloaded ({reason}): predicted time to first token over what a "
            f"{slo_class} request may wait; the queue drains in {wait_s:.1f}s"
        )
        return message, wait_s

    def _stream_drain_s(self, slo_class: SLOClass) -> float | None:
        """None while a stream of this class fits under the adaptive bound; else when a
        slot is expected to free."""
        limit = self._streams
        if limit is None or (slo_class == "batch" and not self._limit_batch):
            return None
        limit.check_loop(self._loop_lag.seconds, self._num_open, time.monotonic())
        if limit.admits(slo_class, self._num_open):
            return None
        return limit.drain_s(self._stream_s.value, self._num_open)

    def _report_turned_away(self, now: float) -> None:
        """Send the pending count of capacity sheds to a decode replica (in the background;
        a lost report only under-counts demand).

        The report runs in a fresh context, not the current request's: a handle call takes
        its request id from the caller's context, and Serve's router matches a pending call
        to the replica it chose by that id. Two calls of one request to the decode pool
        (this report and the request's own generate) share it, so the router hands the
        replica chosen for one to the other and the first one's routing task retries in
        backoff until the call is cancelled (this report's 5 s timeout). Each such orphan
        holds one of the router's two routing tasks per replica; with one decode replica,
        two of them stopped all routing to it for seconds, the requests behind them
        answered 429 seconds late."""
        n = self._turned_away.take(now)
        if n:
            task = asyncio.get_running_loop().create_task(
                self._send_turned_away(n), context=contextvars.Context()
            )
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)

    async def _send_turned_away(self, n: int) -> None:
        async def send() -> None:
            await self._decode.report_turned_away.remote(n)

        try:
            await asyncio.wait_for(send(), TURNED_AWAY_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - best effort; the next report still goes
            logger.debug("turned-away report (%d requests) not delivered: %r", n, err)

    def _shed_at_the_door(self, headers: Any) -> None:
        """HTTP: the door check before the body is read, parsed and tokenized, so a flood
        gets its 429s for the cost of reading headers."""
        shed = self._door(_slo_class(headers))
        if shed is not None:
            message, wait_s = shed
            info = ErrorInfo(
                code=429, type="rate_limit_error", message=message, retry_after_s=wait_s
            )
            raise error_from_info(info)

    async def _generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        shed = self._door(request.slo_class)  # again: gRPC, and hints set meanwhile
        if shed is not None:
            message, wait_s = shed
            yield GenerateChunk.overloaded(request, message, retry_after_s=wait_s)
            return
        ack_s = self._ack_timeout_s(request)
        if ack_s is not None:
            request = request.model_copy(update={"admit_by": time.time() + ack_s})
        response = self._open_decode_stream(request)
        finished = False
        admitted_at, open_before = time.monotonic(), self._num_open
        first_token = False
        self._num_open += 1
        self._serving_metrics.record_streams(self._num_open, self._stream_limit())
        try:
            chunks = aiter(response)
            if ack_s is not None:
                # Not wait_for: its timeout would cancel the call while Serve may still be
                # routing it; the decode replica drops it past admit_by instead.
                decision = asyncio.ensure_future(anext(chunks))
                await asyncio.wait({decision}, timeout=ack_s)
                if not decision.done():
                    finished = True  # the call is left to _drop_late, not cancelled
                    self._leave_late(decision, chunks, response)
                    yield self._not_admitted_in_time(request, admitted_at, open_before)
                    return
                chunks = _prepend(decision.result(), chunks)
            async for chunk in chunks:
                if chunk.ack:  # admitted: the decision came in time
                    continue
                if chunk.token_ids and not first_token:
                    first_token = True
                    self._first_token(admitted_at, open_before, chunk.predicted_ttft_s)
                # Before the yield: a consumer stops at an error chunk (DecodeStream.open
                # raises it as the HTTP 429) and never resumes this generator after it.
                if chunk.finish_reason is not None or chunk.error is not None:
                    finished = True
                err = chunk.error
                if err is not None and err.code == 429 and err.retry_after_s:
                    now = time.monotonic()
                    self._shed_hint.shed(request.slo_class, now, err.retry_after_s)
                    if self._streams is not None:
                        self._streams.refused(admitted_at, open_before, now)
                yield chunk
        except BackPressureError as err:
            # Serve's queue for the decode pool is full (its max_queued_requests): overload,
            # answered like a shed, not as a failure.
            self._serving_metrics.record_shed("serve_queue_full", request.slo_class)
            self._turned_away.add()
            raise OpenAIError(
                f"overloaded (serve_queue_full): {err}",
                status_code=429,
                type="rate_limit_error",
                code="429",
                retry_after_s=max(RETRY_AFTER_S, math.ceil(self._ttft_slo_s or 0.0)),
            ) from err
        except (DeploymentUnavailableError, RayActorError) as err:
            # A replica went away (or none is up): the client may retry.
            raise OpenAIError(
                f"the decode pool is unavailable: {type(err).__name__}",
                status_code=503,
                type="service_unavailable",
                retry_after_s=RETRY_AFTER_S,
            ) from err
        finally:
            self._num_open -= 1
            if first_token:
                self._stream_s.add(time.monotonic() - admitted_at)
            self._serving_metrics.record_streams(self._num_open, self._stream_limit())
            if not finished:
                # The client went away (or we failed): stop the decode replica's work.
                response.cancel()

    def _open_decode_stream(self, request: GenerateRequest) -> MigratingStream:
        """The decode call, moved to another decode replica if its replica dies."""
        return MigratingStream(
            self._decode.options(stream=True).generate.remote,
            request,
            max_migrations=self._max_migrations,
            on_migrate=self._migration_metrics.record,
        )

    def _leave_late(
        self,
        decision: asyncio.Future[GenerateChunk],
        chunks: AsyncIterator[GenerateChunk],
        response: Any,
    ) -> None:
        """Hand a request answered 429 for lack of a timely decision to ``_drop_late``."""
        task = asyncio.get_running_loop().create_task(_drop_late(decision, chunks, response))
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    def _ack_timeout_s(self, request: GenerateRequest) -> float | None:
        """How long to wait for the decode replica's admission decision before answering
        429 here (``admission.admission_ack_timeout_s``); None: as long as it takes (the
        timeout is off, or a batch request that queues)."""
        if self._ack_within_s is None or (request.slo_class == "batch" and not self._limit_batch):
            return None
        arrival = request.arrival_time
        waited = time.time() - arrival if arrival is not None else 0.0
        return admission_ack_timeout_s(self._ack_within_s, waited)

    def _not_admitted_in_time(
        self, request: GenerateRequest, admitted_at: float, open_before: int
    ) -> GenerateChunk:
        """The 429 of a request whose admission decision did not come in time: the path to
        the decode pool (Serve's routing, the replica's loop) is the queue. Cuts the stream
        bound like a refusal; counted as turned-away demand."""
        now = time.monotonic()
        reason = "admission_timeout"
        self._serving_metrics.record_shed(reason, request.slo_class)
        self._turned_away.add()
        wait_s = MIN_DRAIN_S
        if self._streams is not None:
            self._streams.refused(admitted_at, open_before, now)
            wait_s = self._streams.drain_s(self._stream_s.value, self._num_open)
        message = (
            f"overloaded ({reason}): the decode pool did not take the request within "
            f"{now - admitted_at:.2f}s; retry after {wait_s:.1f}s"
        )
        return GenerateChunk.overloaded(request, message, retry_after_s=wait_s)

    def _first_token(self, admitted_at: float, open_before: int, predicted: float | None) -> None:
        """A first token reached this ingress: the TTFT the serving path gave it, against
        the one the decode replica predicted."""
        if self._streams is not None:
            now = time.monotonic()
            lag = self._loop_lag.seconds
            self._streams.observe(
                now - admitted_at, admitted_at, open_before, now, lag, predicted or 0.0
            )

    def _stream_limit(self) -> float | None:
        return self._streams.limit if self._streams is not None else None

    # ------------------------------------------------------------------ HTTP
    async def _serve(
        self, request: Request, route: str, answer: Callable[[], Awaitable[Response]]
    ) -> Response:
        """Admit the caller (key, rate), run ``answer`` and count the response."""
        start = time.monotonic()
        try:
            client = request.client.host if request.client else None
            self._guard.caller(route, request.headers, client)
            response = await answer()
        except OpenAIError as err:
            response = error_response(err)
        self._api_metrics.record_request(route, response.status_code, time.monotonic() - start)
        return response

    async def _json_body(self, request: Request) -> dict[str, Any]:
        raw = await read_body(
            self._timed(request.stream()),
            request.headers.get("content-length"),
            self._api.max_body_bytes,
        )
        return parse_json_body(raw)

    async def _timed(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The body's chunks; the wait for the first one is the proxy's lag (Serve's proxy
        hands the body over on request, through its event loop). Only the first: the rest
        may wait on a slow client's upload."""
        began = time.monotonic()
        first = True
        async for chunk in chunks:
            if first:
                now = time.monotonic()
                self._proxy_lag.observe(now - began, now)
                first = False
            yield chunk

    @app.get("/health")
    async def health(self, request: Request) -> Response:
        return await self._serve(request, "/health", self._health)

    async def _health(self) -> Response:
        ok, detail = await self._check_ready()
        if ok:
            return Response(status_code=200)
        raise OpenAIError(detail, status_code=503, type="service_unavailable")

    @app.get("/ready")
    async def ready(self, request: Request) -> Response:
        return await self._serve(request, "/ready", self._ready)

    async def _ready(self) -> Response:
        ok, detail = await self._check_ready()
        return JSONResponse({"ready": ok, "detail": detail}, status_code=200 if ok else 503)

    @app.get("/version")
    async def version(self, request: Request) -> Response:
        return await self._serve(request, "/version", lambda: _json({"version": PDSERVE_VERSION}))

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        return await self._serve(request, "/metrics", self._metrics)

    async def _metrics(self) -> Response:
        self._api_metrics.record_ready((await self._check_ready())[0])
        body, content_type = self._api_metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        return await self._serve(
            request, "/v1/models", lambda: _json(self.serving.models().model_dump())
        )

    @app.get("/v1/models/{model_id:path}")
    async def get_model(self, request: Request, model_id: str) -> Response:
        return await self._serve(
            request,
            "/v1/models/{id}",
            lambda: _json(self.serving.model_card(model_id).model_dump()),
        )

    @app.post("/tokenize", openapi_extra=request_body(TOKENIZE_SCHEMA))
    async def tokenize(self, request: Request) -> Response:
        return await self._serve(request, "/tokenize", lambda: self._tokenize(request))

    async def _tokenize(self, request: Request) -> Response:
        data = await self._json_body(request)
        kind = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
        req = validate_request(kind, data)
        body = self.serving.tokenize(req).model_dump()
        return JSONResponse(body, headers=ignored_fields_header(req.ignored_fields()))

    @app.post("/detokenize", openapi_extra=request_body(DETOKENIZE_SCHEMA))
    async def detokenize(self, request: Request) -> Response:
        return await self._serve(request, "/detokenize", lambda: self._detokenize(request))

    async def _detokenize(self, request: Request) -> Response:
        req = validate_request(DetokenizeRequest, await self._json_body(request))
        body = self.serving.detokenize(req).model_dump()
        return JSONResponse(body, headers=ignored_fields_header(req.ignored_fields()))

    @app.post("/v1/completions", openapi_extra=request_body(COMPLETION_SCHEMA))
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/completions", lambda: self._completions(request))

    async def _completions(self, request: Request) -> Response:
        self._shed_at_the_door(request.headers)
        req = validate_request(CompletionRequest, await self._json_body(request))
        slo_class = _slo_class(request.headers)
        stream = await self.serving.start_choices(
            req, slo_class=slo_class, trace_headers=request.headers
        )
        created = int(time.time())
        headers = ignored_fields_header(req.ignored_fields())
        if req.stream:
            return _sse(self.serving.completion_events(req, stream, created), headers)
        body = (await self.serving.completion(req, stream, created)).model_dump()
        return JSONResponse(body, headers=headers)

    @app.post("/v1/chat/completions", openapi_extra=request_body(CHAT_SCHEMA))
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/chat/completions", lambda: self._chat(request))

    async def _chat(self, request: Request) -> Response:
        self._shed_at_the_door(request.headers)
        req = validate_request(ChatCompletionRequest, await self._json_body(request))
        slo_class = _slo_class(request.headers)
        stream = await self.serving.start_choices(
            req, slo_class=slo_class, trace_headers=request.headers
        )
        created = int(time.time())
        headers = ignored_fields_header(req.ignored_fields())
        if req.stream:
            return _sse(self.serving.chat_events(req, stream, created), headers)
        body = (await self.serving.chat(req, stream, created)).model_dump()
        return JSONResponse(body, headers=headers)

    async def _check_ready(self) -> tuple[bool, str]:
        now = time.monotonic()
        if now - self._ready_cache[0] < READY_CACHE_S:
            return self._ready_cache[1], self._ready_cache[2]
        if not self._ready_deployments:
            ok, detail = True, "no readiness dependencies"
        else:
            ok, detail = await asyncio.to_thread(self._deployments_running)
        self._ready_cache = (now, ok, detail)
        return ok, detail

    def _deployments_running(self) -> tuple[bool, str]:
        app_name = serve.get_replica_context().app_name
        return pools_ready(serve.status().applications.get(app_name), self._ready_deployments)

    # ------------------------------------------------------------------ gRPC
    async def Check(  # noqa: N802 (grpc.health.v1.Health/Check)
        self, request: health_pb2.HealthCheckRequest, grpc_context: Any = None
    ) -> health_pb2.HealthCheckResponse:
        """SERVING while every pool has a running replica (what GET /health answers)."""
        ok, _ = await self._check_ready()
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ok
            else (health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        return health_pb2.HealthCheckResponse(status=status)

    async def Generate(  # noqa: N802 (the method name must equal the RPC name)
        self, request: pb2.CompletionRequest, grpc_context: Any = None
    ) -> AsyncIterator[pb2.CompletionChunk]:
        req = _grpc_to_openai(request, grpc_context, stream=True)
        stream = await self._grpc_open(req, request, grpc_context)
        try:
            async for chunk in stream:
                out = pb2.CompletionChunk(
                    id=stream.request.request_id,
                    text=chunk.text,
                    token_ids=chunk.token_ids,
                    finish_reason=chunk.finish_reason or "",
                    logprobs=_grpc_logprobs(chunk.logprobs),
                )
                if chunk.finish_reason is not None:
                    out.usage.CopyFrom(_grpc_usage(stream))
                yield out
        except OpenAIError as err:
            _abort_grpc(grpc_context, err)
        finally:
            await stream.close()

    async def Complete(  # noqa: N802 (the method name must equal the RPC name)
        self, request: pb2.CompletionRequest, grpc_context: Any = None
    ) -> pb2.CompletionResult:
        req = _grpc_to_openai(request, grpc_context, stream=False)
        stream = await self._grpc_open(req, request, grpc_context)
        text: list[str] = []
        token_ids: list[int] = []
        logprobs: list[pb2.TokenLogprob] = []
        try:
            async for chunk in stream:
                text.append(chunk.text)
                token_ids.extend(chunk.token_ids)
                logprobs.extend(_grpc_logprobs(chunk.logprobs))
        except OpenAIError as err:
            _abort_grpc(grpc_context, err)
        finally:
            await stream.close()
        return pb2.CompletionResult(
            id=stream.request.request_id,
            text="".join(text),
            token_ids=token_ids,
            finish_reason=stream.finish_reason or "",
            usage=_grpc_usage(stream),
            logprobs=logprobs,
        )

    async def _grpc_open(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        proto: pb2.CompletionRequest,
        grpc_context: Any,
    ) -> DecodeStream:
        try:
            metadata = _metadata(grpc_context)
            return await self.serving.start(
                req,
                request_id=proto.request_id or None,
                slo_class=_slo_class(metadata),
                trace_headers=metadata,
            )
        except OpenAIError as err:
            _abort_grpc(grpc_context, err)
            raise  # unreachable: _abort_grpc raises
