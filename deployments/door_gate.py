"""``DoorGate``: a raw ASGI middleware that asks the ingress's door about a generate request
before FastAPI routes it, so that a flood's 429s cost the ASGI call and a header lookup,
not routing, a Request object and the route handler's wrappers.

For the routes it guards (POST, exact paths) it asks the replica's ``HTTPDoor``: the
caller's key and rate (``APIGuard``), the priority header, then ``FrontDoor.admit``. A
refusal is answered there with the OpenAI error body (and Retry-After); a request let
through goes on to the app with its ``DoorPass`` in the ASGI scope under
``DOOR_PASS_SCOPE_KEY``, released when the app is done with the request. Other routes and
methods pass untouched. It never reads a body and holds no state of its own: the door and
the guard are the replica's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.deployments.admission.front_door import DoorPass, DoorShed, FrontDoor
from pdserve.deployments.admission.rules import Priority
from pdserve.deployments.api_guard import APIGuard
from pdserve.deployments.openai_protocol import OpenAIError

PRIORITY_HEADER = "x-pdserve-priority"
DOOR_PASS_SCOPE_KEY = "pdserve.door_pass"


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

    def __init__(self, guard: APIGuard, door: FrontDoor, requests: RequestCounter) -> None:
        self.guard = guard
        self.door = door
        self._requests = requests

    def gate(self, route: str, headers: Headers, client: str | None) -> DoorPass | JSONResponse:
        """The door's pass for the route handler, or the refusal to answer (counted under
        ``route`` as the handler's responses are)."""
        start = time.monotonic()
        try:
            self.guard.caller(route, headers, client)
            admitted = self.door.admit(request_priority(headers))
            if isinstance(admitted, DoorPass):
                return admitted
            err = overloaded_error(admitted)
        except OpenAIError as refused:
            err = refused
        self._requests.record_request(route, err.status_code, time.monotonic() - start)
        return error_response(err)

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
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        route = route_path(scope)
        if route not in self._routes:
            await self.app(scope, receive, send)
            return
        door = self._http_door()
        client = scope.get("client")
        verdict = door.gate(route, Headers(scope=scope), client[0] if client else None)
        if not isinstance(verdict, DoorPass):
            await verdict(scope, receive, send)
            return
        passed: dict[str, Any] = {**scope, DOOR_PASS_SCOPE_KEY: verdict}
        try:
            await self.app(passed, receive, send)
        finally:
            door.release(verdict)
