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
The request header ``x-pdserve-priority`` (gRPC: metadata of that name) is ``interactive``
(default) or ``batch``: admission control on the decode replica sheds batch first and lets
it queue longer. The ingress's own overload control is its ``FrontDoor``
(``admission/front_door.py``), asked once per request before its body is read (over HTTP
by ``DoorGate``, before FastAPI routes the request).
Serve bounds the ingress (``app.ingress_bounds``): past what the decode pool admits, Serve's
proxy answers 429 itself; a full Serve queue for the decode pool is a 429 here too.
gRPC: ``pdserve.v1.PDServe.Generate`` (server streaming) and ``.Complete`` (unary) from
``deployments/grpc/pdserve.proto``, and ``grpc.health.v1.Health/Check``, through Serve's
gRPC proxy.
"""

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
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

from pdserve.deployments.admission.front_door import (
    DoorPass,
    DoorShed,
    FrontDoor,
    FrontDoorSettings,
)
from pdserve.deployments.admission.rules import Priority
from pdserve.deployments.api_guard import APIGuard, read_body
from pdserve.deployments.config import APIConfig, ObservabilityConfig
from pdserve.deployments.decode_stream import DecodeStream
from pdserve.deployments.door_gate import (
    DOOR_PASS_SCOPE_KEY,
    GENERATE_ROUTES,
    DoorGate,
    HTTPDoor,
    error_response,
    overloaded_error,
    request_priority,
)
from pdserve.deployments.grpc import pdserve_pb2 as pb2
from pdserve.deployments.handle_warmup import start_warm_up
from pdserve.deployments.ingress_telemetry import IngressTelemetry
from pdserve.deployments.messages import (
    GenerateChunk,
    GenerateRequest,
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

READY_CACHE_S = 1.0
RETRY_AFTER_S = 1.0
TURNED_AWAY_TIMEOUT_S = 5.0

PDSERVE_VERSION = package_version("pdserve")

app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
install_openapi(app)
# A flood's 429s before FastAPI routes them (the routes that pass the door).
app.add_middleware(DoorGate, routes=GENERATE_ROUTES)


async def _json(body: dict[str, Any]) -> Response:
    return JSONResponse(body)


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, err: OpenAIError) -> JSONResponse:
    return error_response(err)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and wrong methods get the OpenAI error body too.
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return error_response(OpenAIError(str(err.detail), status_code=err.status_code, type=kind))


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


def _overloaded(request: GenerateRequest, shed: DoorShed) -> GenerateChunk:
    return GenerateChunk.overloaded(request, shed.message, retry_after_s=shed.retry_after_s)


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


def _door_pass_var() -> contextvars.ContextVar[DoorPass | None]:
    """The door's pass of the request being handled (``OpenAIIngress._through_door``): its
    first decode call takes its place under the stream bound."""
    return contextvars.ContextVar("pdserve_door_pass", default=None)


def _grpc_usage(stream: DecodeStream) -> pb2.Usage:
    usage = stream.usage()
    return pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_tokens=usage.prompt_tokens_details.cached_tokens,
    )


# The class comes last: @serve.ingress pickles the app (and so these methods) when the
# class is defined, capturing only the module globals that exist at that point.
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
        door: what this replica sheds at its door (``FrontDoorSettings.from_config``);
            None = nothing (no shedding of pdserve's own at the ingress).
        max_migrations: how often one stream may move to another decode replica.
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
        door: FrontDoorSettings | None = None,
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
        self._serving_metrics = metrics
        self._max_migrations = max_migrations
        self._migration_metrics = MigrationMetrics(
            model_name=info.name,
            replica=serve.get_replica_context().replica_tag,
            enabled=observability.metrics_enabled,
        )
        self.door = FrontDoor(door or FrontDoorSettings(), metrics, self._report_turned_away)
        self.http_door = HTTPDoor(  # for DoorGate
            self._guard, self.door, self._api_metrics, serve.get_replica_context().replica_tag
        )
        self._door_pass = _door_pass_var()
        self._warmups: set[asyncio.Task[bool]] = set()
        self._warm_decode()
        self._reports: set[asyncio.Task[None]] = set()
        self._late: set[asyncio.Task[None]] = set()  # calls answered 429, left to end
        self._ready_deployments = list(ready_deployments or [])
        self._ready_cache: tuple[float, bool, str] = (0.0, False, "")

    def _warm_decode(self) -> None:
        """Use the decode handle once while this replica starts, so that the first burst
        does not wait for its router (``handle_warmup``)."""
        start_warm_up(lambda: self._decode.num_open_streams.remote(), "decode", self._warmups)

    def _report_turned_away(self, n: int) -> None:
        """Send a count of the door's capacity sheds to a decode replica (in the background;
        a lost report only under-counts demand). It runs in a fresh context: a handle call
        sharing the current request's Serve id would be confused with that request's own
        call by Serve's router (docs/decisions.md, decision 3)."""
        task = contextvars.Context().run(asyncio.create_task, self._send_turned_away(n))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _send_turned_away(self, n: int) -> None:
        async def send() -> None:
            await self._decode.report_turned_away.remote(n)

        try:
            await asyncio.wait_for(send(), TURNED_AWAY_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - best effort; the next report still goes
            logger.debug("turned-away report (%d requests) not delivered: %r", n, err)

    @contextlib.contextmanager
    def _through_door(self, priority: Priority, passed: DoorPass | None = None) -> Iterator[None]:
        """The door check, once per request and before its body is read, parsed and
        tokenized, so that a flood gets its 429s for the cost of reading headers (``passed``:
        ``DoorGate`` asked already, and this is its pass). A request let through holds its
        place under the stream bound while its body is read and its stream opened in the
        block; a place its stream did not take is freed at the end."""
        admitted = self.door.admit(priority) if passed is None else passed
        if isinstance(admitted, DoorShed):
            raise overloaded_error(admitted)
        token = self._door_pass.set(admitted)
        try:
            yield
        finally:
            self._door_pass.reset(token)
            self.door.release(admitted)

    async def _generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        door = self.door
        ack_s = door.ack_timeout_s(request.priority, request.arrival_time)
        if ack_s is not None:
            request = request.model_copy(update={"admit_by": time.time() + ack_s})
        response = self._open_decode_stream(request)
        finished = False
        ticket = door.opened(request.priority, self._door_pass.get())
        first_token = False
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
                    yield _overloaded(request, door.not_admitted_in_time(ticket))
                    return
                chunks = _prepend(decision.result(), chunks)
            async for chunk in chunks:
                if chunk.replica is not None:
                    door.heard_from(chunk.replica)
                if chunk.ack:  # admitted: the decision came in time
                    continue
                if chunk.token_ids and not first_token:
                    first_token = True
                    door.first_token(ticket, chunk.predicted_ttft_s)
                # Before the yield: a consumer stops at an error chunk (DecodeStream.open
                # raises it as the HTTP 429) and never resumes this generator after it.
                if chunk.finish_reason is not None or chunk.error is not None:
                    finished = True
                err = chunk.error
                if err is not None and err.code == 429 and err.retry_after_s:
                    # The client may retry when any replica has room, not only this one.
                    retry_s = door.refused(ticket, err.retry_after_s, chunk.replica)
                    if retry_s < err.retry_after_s:
                        err = err.model_copy(update={"retry_after_s": retry_s})
                        chunk = chunk.model_copy(update={"error": err})
                yield chunk
        except BackPressureError as err:
            # Serve's queue for the decode pool is full (its max_queued_requests): overload,
            # answered like a shed, not as a failure.
            raise OpenAIError(
                f"overloaded (serve_queue_full): {err}",
                status_code=429,
                type="rate_limit_error",
                code="429",
                retry_after_s=door.serve_queue_full(ticket),
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
            door.closed(ticket, first_token)
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

    # ------------------------------------------------------------------ HTTP
    async def _serve(
        self, request: Request, route: str, answer: Callable[[], Awaitable[Response]]
    ) -> Response:
        """Admit the caller (key, rate), run ``answer`` and count the response."""
        start = time.monotonic()
        try:
            if DOOR_PASS_SCOPE_KEY not in request.scope:  # else DoorGate checked the caller
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
                self.door.body_wait(time.monotonic() - began)
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
        priority = request_priority(request.headers)
        with self._through_door(priority, request.scope.get(DOOR_PASS_SCOPE_KEY)):
            req = validate_request(CompletionRequest, await self._json_body(request))
            stream = await self.serving.start_choices(
                req, priority=priority, trace_headers=request.headers
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
        priority = request_priority(request.headers)
        with self._through_door(priority, request.scope.get(DOOR_PASS_SCOPE_KEY)):
            req = validate_request(ChatCompletionRequest, await self._json_body(request))
            stream = await self.serving.start_choices(
                req, priority=priority, trace_headers=request.headers
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
            priority = request_priority(metadata)
            with self._through_door(priority):
                return await self.serving.start(
                    req,
                    request_id=proto.request_id or None,
                    priority=priority,
                    trace_headers=metadata,
                )
        except OpenAIError as err:
            _abort_grpc(grpc_context, err)
            raise  # unreachable: _abort_grpc raises
