"""``DoorGate``: a raw ASGI middleware that asks the ingress's door about a generate request
before FastAPI routes it, so that a flood's 429s cost the ASGI call and a header lookup,
not routing, a Request object and the route handler's wrappers.

For the routes it guards (POST, exact paths) it asks the replica's ``HTTPDoor``: the
caller's key and rate (``APIGuard``), the priority header, then ``FrontDoor.admit``. A
refusal is answered there with the OpenAI error body (and Retry-After); a request let
through goes on to the app with its ``DoorPass`` in the ASGI scope under
``DOOR_PASS_SCOPE_KEY``, released when the app is done with the request. Other routes and
methods pass untouched, but every response states the door's bound (``STREAMS_HEADER``).
It never reads a body and holds no state of its own: the door and the guard are the
replica's.

``EdgeGate`` is the same check one step earlier, as Serve's HTTP callback
(``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` = ``EDGE_CALLBACK``): ahead of Serve's own
request handling on the HTTP server of a direct-ingress ingress replica, where a flood's 429
then costs no more than the HTTP server's parsing. It asks the door only where the door
lives on the server's own thread (the ingress runs its code on Serve's loop); elsewhere (a
Serve proxy, an ingress whose code runs on a thread of its own) it leaves the check to
``DoorGate``. In a Serve proxy it answers for a full door from the bound the door states on
every response (``edge_bound.EdgeBound``; ``DoorGate`` states it) and repeats the door's
last refusal for a moment (``EdgeLatch``). On every server it runs on, it gives Serve's own
plain-text error responses (its queue bound's "Request dropped due to backpressure", a
draining replica's 503) the OpenAI error body.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.deployments.admission.front_door import DoorPass, DoorShed, FrontDoor
from pdserve.deployments.admission.rules import Priority
from pdserve.deployments.api_guard import APIGuard
from pdserve.deployments.edge_bound import STREAMS_HEADER, EdgeBound, streams_header
from pdserve.deployments.openai_protocol import OpenAIError

PRIORITY_HEADER = "x-pdserve-priority"
DOOR_PASS_SCOPE_KEY = "pdserve.door_pass"
GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions")
# On the door's 429: its reason. A proxy's EdgeGate closes on it (``EdgeLatch``).
SHED_HEADER = "x-pdserve-shed"
# On a request a proxy's EdgeGate forwards: the refusals it answered for the door since the
# last one it forwarded, per priority ("interactive=12,batch=3"). Taken from no one else.
EDGE_SHED_HEADER = "x-pdserve-edge-shed"
_EDGE_SHED_KEY = EDGE_SHED_HEADER.encode()
_STREAMS_KEY = STREAMS_HEADER.encode()
# How long a door's 429 closes a proxy's EdgeGate for requests like it (at most: a stream
# that ends through the proxy opens it at once).
EDGE_HOLD_S = 0.1
# Serve's HTTP callback: set in the environment of the processes that run Serve's HTTP servers.
EDGE_CALLBACK = "pdserve.deployments.door_gate:serve_http_middlewares"
# The ingress replica's environment: its code on Serve's own event loop, where EdgeGate may
# ask its door (docs/decisions.md, decision 9), and EdgeGate on its HTTP server.
INGRESS_REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": EDGE_CALLBACK,
}


def request_priority(headers: Mapping[str, str]) -> Priority:
    """The request's priority class from its headers (or gRPC metadata as a mapping)."""
    value = headers.get(PRIORITY_HEADER)
    if value in (None, "", "interactive"):
        return "interactive"
    if value == "batch":
        return "batch"
    raise OpenAIError(
        f"header {PRIORITY_HEADER} must be 'interactive' or 'batch', got {value!r}",
        param=PRIORITY_HEADER,
        code="invalid_value",
    )


def overloaded_error(shed: DoorShed) -> OpenAIError:
    """The door's refusal as the client gets it: 429, the OpenAI body, Retry-After."""
    return OpenAIError(
        shed.message,
        status_code=429,
        type="rate_limit_error",
        code="429",
        retry_after_s=shed.retry_after_s,
    )


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers())


class RequestCounter(Protocol):
    def record_request(self, route: str, status: int, seconds: float) -> None: ...


class HTTPDoor:
    """An ingress replica's checks of an HTTP generate request before its body is read:
    what ``DoorGate`` asks."""

    def __init__(
        self, guard: APIGuard, door: FrontDoor, requests: RequestCounter, replica: str = ""
    ) -> None:
        """``replica``: the replica's name, in the bound its responses state."""
        self.guard = guard
        self.door = door
        self._requests = requests
        self._replica = replica
        # The door is not thread-safe: only code on this thread may ask it (``EdgeGate``).
        self.thread = threading.get_ident()

    def streams_header(self) -> bytes | None:
        """``STREAMS_HEADER``'s value now (None: the door does not bound its streams)."""
        bounds = self.door.stream_bounds()
        if bounds is None:
            return None
        return streams_header(self._replica, bounds, self.guard.keyed).encode()

    def gate(self, route: str, headers: Headers, client: str | None) -> DoorPass | JSONResponse:
        """The door's pass for the route handler, or the refusal to answer (counted under
        ``route`` as the handler's responses are)."""
        start = time.monotonic()
        shed: DoorShed | None = None
        if (report := headers.get(EDGE_SHED_HEADER)) is not None:  # whoever this caller is
            for slo_class, n in parse_edge_report(report).items():
                self.door.edge_refused(slo_class, n)
        try:
            self.guard.caller(route, headers, client)
            admitted = self.door.admit(request_priority(headers))
            if isinstance(admitted, DoorPass):
                return admitted
            shed = admitted
            err = overloaded_error(admitted)
        except OpenAIError as refused:
            err = refused
        self._requests.record_request(route, err.status_code, time.monotonic() - start)
        response = error_response(err)
        if shed is not None:
            response.headers[SHED_HEADER] = shed.reason
        return response

    def release(self, door_pass: DoorPass) -> None:
        self.door.release(door_pass)


def replica_http_door() -> HTTPDoor:
    """The Serve replica's ``HTTPDoor``: that of the instance FastAPI's class-based routes
    run on (the ingress's ``http_door``)."""
    from ray import serve

    ingress: Any = serve.get_replica_context().servable_object  # typed as any callable
    http_door: HTTPDoor = ingress.http_door
    return http_door


def route_path(scope: Scope) -> str:
    """The path the app routes on (the route prefix, Serve's ``root_path``, removed)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path


class DoorGate:
    """The door check ahead of the app's routing, for POST requests to ``routes``."""

    def __init__(
        self,
        app: ASGIApp,
        routes: Collection[str],
        http_door: Callable[[], HTTPDoor] = replica_http_door,
    ) -> None:
        """``http_door`` returns the replica's door, asked on each guarded request (tests
        pass their own)."""
        self.app = app
        self._routes = frozenset(routes)
        self._http_door = http_door

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        door = self._http_door()
        send = _stating_bound(send, door)
        route = route_path(scope)
        if scope["method"] != "POST" or route not in self._routes:
            await self.app(scope, receive, send)
            return
        if DOOR_PASS_SCOPE_KEY in scope:  # EdgeGate asked the door already
            await self.app(scope, receive, send)
            return
        await through_door(door, route, self.app, scope, receive, send)


def _stating_bound(send: Send, door: HTTPDoor) -> Send:
    """``send``, with the door's bound as it stands then on the response's start."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start" and (value := door.streams_header()):
            message = {**message, "headers": [*message.get("headers", []), (_STREAMS_KEY, value)]}
        await send(message)

    return wrapped


async def through_door(
    door: HTTPDoor, route: str, app: ASGIApp, scope: Scope, receive: Receive, send: Send
) -> None:
    """Answer the door's refusal, or run ``app`` with the door's pass in the scope (released
    when ``app`` is done: the route handler's stream has taken it over by then)."""
    client = scope.get("client")
    verdict = door.gate(route, Headers(scope=scope), client[0] if client else None)
    if not isinstance(verdict, DoorPass):
        await verdict(scope, receive, send)
        return
    passed: dict[str, Any] = {**scope, DOOR_PASS_SCOPE_KEY: verdict}
    try:
        await app(passed, receive, send)
    finally:
        door.release(verdict)


def serve_http_middlewares() -> list[Middleware]:
    """Serve's HTTP callback (``EDGE_CALLBACK``): the middlewares of its HTTP servers."""
    return [Middleware(EdgeGate, routes=GENERATE_ROUTES)]


def same_thread_http_door() -> HTTPDoor | None:
    """The ingress replica's ``HTTPDoor`` where this thread may ask it; None in a process
    that is not a replica (Serve's proxy), before the replica's code is up, in a replica that
    is not pdserve's ingress, and where the ingress runs its code on a thread of its own."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        servable = serve.get_replica_context().servable_object
    except RayServeException:
        return None
    door = getattr(servable, "http_door", None)
    if not isinstance(door, HTTPDoor) or door.thread != threading.get_ident():
        return None
    return door


def parse_edge_report(value: str) -> dict[Priority, int]:
    """``EDGE_SHED_HEADER``'s counts; what does not parse is dropped (best effort)."""
    counts: dict[Priority, int] = {}
    for item in value.split(","):
        name, _, n = item.partition("=")
        name = name.strip()
        if name in ("interactive", "batch") and n.strip().isdigit():
            slo_class: Priority = "interactive" if name == "interactive" else "batch"
            counts[slo_class] = counts.get(slo_class, 0) + int(n)
    return counts


LatchKey = tuple[str, str, str]  # priority header, Authorization, X-Api-Key


@dataclass(frozen=True)
class _Refusal:
    """A 429 the proxy answers for the door: its response's start and body."""

    start: Message
    body: bytes
    priority: Priority


class EdgeLatch:
    """What a Serve proxy's EdgeGate knows of the ingress's door, from the door's own
    refusals: a 429 that carries ``SHED_HEADER`` closes the latch for requests with the same
    priority and credentials for ``hold_s``, and a served (2xx) response that completes
    through this proxy (a stream ended: a place at the door freed) opens every key. While
    closed, the proxy answers the door's last refusal itself, and counts it; the counts ride
    on the next request it forwards (``EDGE_SHED_HEADER``), so that the door's shed metrics
    and its turned-away demand see them. Keyed by credentials too, so that a wrong key still
    gets the ingress's 401, never a 429 learned from another caller's request."""

    def __init__(
        self, hold_s: float = EDGE_HOLD_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._closed: dict[LatchKey, tuple[_Refusal, float]] = {}  # the answer, until when
        self._unreported: dict[Priority, int] = {}

    def refusal(self, key: LatchKey) -> _Refusal | None:
        """The refusal to answer a request with this key now, counted; None: forward it."""
        closed = self._closed.get(key)
        if closed is None:
            return None
        refusal, until = closed
        if self._clock() >= until:
            del self._closed[key]
            return None
        self.count(refusal.priority)
        return refusal

    def count(self, priority: Priority) -> None:
        """The proxy answered a request of this class for the door: report it."""
        self._unreported[priority] = self._unreported.get(priority, 0) + 1

    def close(self, key: LatchKey, priority: Priority, start: Message, body: bytes) -> None:
        if len(self._closed) >= MAX_LATCH_KEYS:
            self._closed.clear()  # many callers' keys: start afresh, never grow unbounded
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"x-request-id"]
        until = self._clock() + self.hold_s
        self._closed[key] = (_Refusal({**start, "headers": headers}, body, priority), until)

    def open(self) -> None:
        self._closed.clear()

    def take_report(self) -> str | None:
        """``EDGE_SHED_HEADER``'s value for the next forwarded request (None: nothing to say)."""
        if not self._unreported:
            return None
        report = ",".join(f"{name}={n}" for name, n in self._unreported.items())
        self._unreported = {}
        return report


MAX_LATCH_KEYS = 1024


class EdgeGate:
    """The door check on Serve's HTTP server, ahead of Serve's request handling (see the
    module's docstring), and the OpenAI error body on Serve's own plain-text errors. Where
    the door is not on this thread (a Serve proxy), an ``EdgeLatch`` and an ``EdgeBound``
    answer for it."""

    def __init__(
        self,
        app: ASGIApp,
        routes: Collection[str],
        http_door: Callable[[], HTTPDoor | None] = same_thread_http_door,
        latch: EdgeLatch | None = None,
        bound: EdgeBound | None = None,
    ) -> None:
        self.app = app
        self._routes = frozenset(routes)
        self._http_door = http_door
        self.latch = latch if latch is not None else EdgeLatch()
        self.bound = bound if bound is not None else EdgeBound()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = openai_error_bodies(send)
        door = self._http_door()
        route = route_path(scope)
        if scope["method"] != "POST" or route not in self._routes:
            await self.app(scope, receive, self._bound_from(send, learn=door is None))
            return
        if door is not None:
            scope = {**scope, "headers": _without(scope["headers"], _EDGE_SHED_KEY)}
            await through_door(door, route, self.app, scope, receive, self._bound_from(send, False))
            return
        key = _latch_key(Headers(scope=scope))
        if (refusal := self._refusal(key)) is not None:
            await send(refusal.start)
            await send({"type": "http.response.body", "body": refusal.body})
            return
        headers = _without(scope["headers"], _EDGE_SHED_KEY)
        if (report := self.latch.take_report()) is not None:
            headers.append((_EDGE_SHED_KEY, report.encode()))
        self.bound.in_flight += 1
        try:
            await self.app({**scope, "headers": headers}, receive, self._watch(send, key))
        finally:
            self.bound.in_flight -= 1

    def _refusal(self, key: LatchKey) -> _Refusal | None:
        """The answer the proxy gives for the door (counted), or None to forward."""
        if (latched := self.latch.refusal(key)) is not None:
            return latched
        priority: Priority | None = _PRIORITIES.get(key[0])
        if priority is None:  # not a class: the ingress answers 400
            return None
        shed = self.bound.refusal(priority, key[1:])
        if shed is None:
            return None
        self.latch.count(priority)
        response = error_response(overloaded_error(shed))
        response.headers[SHED_HEADER] = shed.reason
        start = {"type": "http.response.start", "status": 429, "headers": response.raw_headers}
        return _Refusal(start, bytes(response.body), priority)

    def _bound_from(self, send: Send, learn: bool = True) -> Send:
        """``send``, without the bound the ingress states on its response's start (learnt
        first where ``learn``)."""

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message, _ = self._strip_bound(message, learn)
            await send(message)

        return wrapped

    def _strip_bound(self, start: Message, learn: bool) -> tuple[Message, bool]:
        """The response's start without the bound, and whether it stated one."""
        headers = start.get("headers", [])
        for name, value in headers:
            if name == _STREAMS_KEY:
                if learn:
                    self.bound.heard(value.decode("latin-1"))
                return {**start, "headers": _without(headers, _STREAMS_KEY)}, True
        return start, False

    def _watch(self, send: Send, key: LatchKey) -> Send:
        """``send``, learning the bound; closing the latch on the door's 429 and opening it
        when a served response (2xx) completes."""
        start: Message | None = None
        served = refused = False
        body = bytearray()

        async def wrapped(message: Message) -> None:
            nonlocal start, served, refused
            if message["type"] == "http.response.start":
                message, stated = self._strip_bound(message, learn=True)
                await send(message)
                start = message
                served = 200 <= message["status"] < 300
                refused = message["status"] == 429 and SHED_HEADER in _headers(message)
                if refused or served:
                    self.bound.passed(key[1:])  # the caller passed the door's key check
                if served and not stated:
                    self.bound.unbounded()
                return
            await send(message)
            if message["type"] != "http.response.body" or start is None:
                return
            if refused:
                body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            if refused:  # the door refused for load: the priority header was a class
                self.latch.close(key, _PRIORITIES.get(key[0], "interactive"), start, bytes(body))
            elif served:
                self.latch.open()

        return wrapped


_PRIORITIES: dict[str, Priority] = {"interactive": "interactive", "batch": "batch"}


def _without(headers: list[tuple[bytes, bytes]], name: bytes) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k != name]


def _latch_key(headers: Headers) -> LatchKey:
    priority = headers.get(PRIORITY_HEADER) or "interactive"
    return priority, headers.get("authorization", ""), headers.get("x-api-key", "")


def _headers(message: Message) -> Headers:
    return Headers(raw=message.get("headers", []))


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
}


def _error_type(status: int) -> str:
    default = "server_error" if status >= 500 else "invalid_request_error"
    return _ERROR_TYPES.get(status, default)


def openai_error_bodies(send: Send) -> Send:
    """``send``, with an error response in plain text (Serve's own: its queue bound's 429,
    a draining replica's 503, an unknown route prefix's 404) turned into the OpenAI error
    body with the same status and headers (Retry-After kept). Other responses pass as
    they are, streamed ones included."""
    held: Message | None = None
    text = bytearray()

    async def wrapped(message: Message) -> None:
        nonlocal held
        if held is None:
            if message["type"] == "http.response.start" and _plain_error(message):
                held = message
                return
            await send(message)
            return
        text.extend(message.get("body", b""))
        if message.get("more_body", False):
            return
        status = held["status"]
        err = OpenAIError(
            text.decode("utf-8", "replace").strip() or f"HTTP {status}",
            status_code=status,
            type=_error_type(status),
            code=str(status),
        )
        body = json.dumps(err.body()).encode()
        headers = MutableHeaders(raw=list(held.get("headers", [])))
        headers["content-type"] = "application/json"
        headers["content-length"] = str(len(body))
        await send({**held, "headers": headers.raw})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return wrapped


def _plain_error(start: Message) -> bool:
    if start["status"] < 400:
        return False
    return _headers(start).get("content-type", "").startswith("text/plain")
