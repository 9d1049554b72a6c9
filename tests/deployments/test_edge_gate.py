"""``EdgeGate``: the door's check on Serve's HTTP server, ahead of Serve's request handling.

In a direct-ingress ingress replica it asks the door itself and hands the pass on (the app's
``DoorGate`` then does not ask again). In a Serve proxy, where the door is another process's,
an ``EdgeLatch`` learns from the door's 429s and answers for it for a moment, reporting what
it answered with the next request it forwards. On every server, Serve's own plain-text
errors get the OpenAI error body."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdserve.deployments.admission.front_door import (
    DoorPass,
    FrontDoor,
    FrontDoorSettings,
    StreamBounds,
)
from pdserve.deployments.api_guard import APIGuard
from pdserve.deployments.config import APIConfig
from pdserve.deployments.door_gate import (
    DOOR_PASS_SCOPE_KEY,
    EDGE_SHED_HEADER,
    SHED_HEADER,
    DoorGate,
    EdgeGate,
    EdgeLatch,
    HTTPDoor,
    openai_error_bodies,
    parse_edge_report,
)
from pdserve.deployments.edge_bound import (
    STREAMS_HEADER,
    EdgeBound,
    parse_streams_header,
    streams_header,
)
from tests.deployments.admission_fakes import DoorRecord, one_stream_door

ROUTES = ("/v1/completions", "/v1/chat/completions")


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Counted:
    def record_request(self, route: str, status: int, seconds: float) -> None:
        pass


class _Ingress:
    """A door with a stream bound of one and the ingress's app behind its ``DoorGate``: what
    reaches the route (and how many passes the door holds then) is recorded."""

    def __init__(self, api: dict[str, Any] | None = None) -> None:
        self.record = DoorRecord()
        self.door = one_stream_door(self.record)
        self.http_door = HTTPDoor(APIGuard(APIConfig(**(api or {}))), self.door, _Counted())
        self.reached: list[tuple[str, bool, int]] = []  # path, held a pass, passes held
        self.hold: asyncio.Event | None = None  # set: requests wait for it (a stream open)

        async def endpoint(request: Request) -> JSONResponse:
            door_pass = request.scope.get(DOOR_PASS_SCOPE_KEY)
            held = isinstance(door_pass, DoorPass) and door_pass.held
            self.reached.append((request.url.path, held, self.door.num_passed))
            if self.hold is not None:
                await self.hold.wait()
            return JSONResponse({"ok": True})

        routes = [Route(p, endpoint, methods=["POST"]) for p in ROUTES]
        self.app = DoorGate(Starlette(routes=routes), ROUTES, lambda: self.http_door)


def _post(app: Any, path: str = "/v1/completions", **kwargs: Any) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, content=b'{"prompt": "hi"}', **kwargs)

    return asyncio.run(send())


# ---------------------------------------------------------------- the door on this thread
def test_the_edge_asks_the_door_once_and_hands_its_pass_to_the_app() -> None:
    """Direct ingress: the edge admits, the app's DoorGate sees the pass and does not admit
    again (one place held, not two), and the place is free afterwards; with the door closed
    the edge answers the door's 429 (OpenAI body, Retry-After, the shed's reason) and
    nothing reaches the app."""
    ingress = _Ingress()
    edge = EdgeGate(ingress.app, ROUTES, lambda: ingress.http_door)

    assert _post(edge).status_code == 200
    assert ingress.reached == [("/v1/completions", True, 1)]
    assert ingress.door.num_passed == 0

    ingress.door.opened("interactive")  # a stream takes the one place
    refused = _post(edge, "/v1/chat/completions")
    assert refused.status_code == 429
    assert refused.json()["error"]["message"].startswith("overloaded (concurrency)")
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers[SHED_HEADER] == "concurrency"
    assert len(ingress.reached) == 1 and ingress.record.sheds == ["concurrency"]


def test_a_client_cannot_report_edge_refusals_itself() -> None:
    """``x-pdserve-edge-shed`` is the proxy edge's to send: a client's is dropped, so it can
    neither inflate the shed metrics nor the turned-away demand."""
    ingress = _Ingress()
    edge = EdgeGate(ingress.app, ROUTES, lambda: ingress.http_door)
    proxy = EdgeGate(ingress.app, ROUTES, lambda: None)

    for app in (edge, proxy):
        assert _post(app, headers={EDGE_SHED_HEADER: "interactive=100"}).status_code == 200
    assert ingress.record.sheds == [] and ingress.door.turned_away.pending == 0


# ---------------------------------------------------------------- a Serve proxy's latch
class _Proxy:
    """A proxy's edge (no door on its thread) in front of the ingress, on a fake clock."""

    def __init__(self, api: dict[str, Any] | None = None) -> None:
        self.ingress = _Ingress(api)
        self.clock = _Clock()
        self.latch = EdgeLatch(hold_s=0.1, clock=self.clock)
        self.bound = EdgeBound(clock=self.clock)
        self.edge = EdgeGate(self.ingress.app, ROUTES, lambda: None, self.latch, self.bound)

    def post(self, **kwargs: Any) -> httpx.Response:
        return _post(self.edge, **kwargs)


def test_a_door_refusal_closes_the_proxy_for_a_moment_and_its_answers_reach_the_door() -> None:
    """The door's 429 passes through and closes the latch: the next two requests get that
    429 from the proxy (nothing reaches the ingress); past the hold the next one reaches the
    door, carrying the count, which the door records as sheds (``proxy_edge``) and as
    turned-away demand."""
    p = _Proxy()
    p.ingress.door.opened("interactive")

    first = p.post()
    assert first.status_code == 429 and p.ingress.record.sheds == ["concurrency"]
    latched = [p.post() for _ in range(2)]
    assert [r.status_code for r in latched] == [429, 429]
    assert all(r.json() == first.json() for r in latched)
    assert all(r.headers["retry-after"] == first.headers["retry-after"] for r in latched)
    assert p.ingress.record.sheds == ["concurrency"]  # the ingress saw none of them

    p.clock.now += 0.1
    assert p.post().status_code == 429  # reached the door, which is still full
    assert p.ingress.record.sheds == ["concurrency", "proxy_edge", "proxy_edge", "concurrency"]
    door = p.ingress.door
    assert sum(p.ingress.record.reported) + door.turned_away.pending == 4


def test_a_response_completed_through_the_proxy_opens_it() -> None:
    """A place freed at the door shows at the proxy as a response that completes: after a
    batch request's 200 (the door does not bound batch) the next interactive request
    reaches the door and is admitted, within the hold."""
    p = _Proxy()
    stream = p.ingress.door.opened("interactive")
    assert p.post().status_code == 429
    assert p.post().status_code == 429  # latched
    p.ingress.door.closed(stream, had_first_token=True)
    assert p.post().status_code == 429  # the proxy cannot know yet

    assert p.post(headers={"x-pdserve-priority": "batch"}).status_code == 200
    assert p.post().status_code == 200
    assert [path for path, _, _ in p.ingress.reached] == ["/v1/completions"] * 2


def test_the_latch_is_per_caller_key_and_priority() -> None:
    """A 429 learned from one caller's request is never another's answer: a wrong or
    missing key still gets the ingress's 401, another key and the batch class reach the
    door."""
    p = _Proxy(api={"api_keys": ["sk-edge-a", "sk-edge-b"]})
    p.ingress.door.opened("interactive")
    a = {"authorization": "Bearer sk-edge-a"}

    assert p.post(headers=a).status_code == 429
    assert p.post(headers=a).status_code == 429
    sheds = list(p.ingress.record.sheds)
    assert p.post(headers={"authorization": "Bearer sk-edge-wrong"}).status_code == 401
    assert p.post().status_code == 401
    assert p.post(headers={"authorization": "Bearer sk-edge-b"}).status_code == 429
    assert p.post(headers={**a, "x-pdserve-priority": "batch"}).status_code == 429
    # The latched answer is counted with the next request forwarded, a 401 one too.
    assert p.ingress.record.sheds == [*sheds, "proxy_edge", "concurrency", "concurrency"]


def test_other_429s_do_not_close_the_latch() -> None:
    """A 429 without the door's reason (a caller's rate limit) closes nothing."""
    p = _Proxy(api={"api_keys": ["sk-edge-a"], "rate_limit_per_minute": 1, "rate_limit_burst": 1})
    a = {"authorization": "Bearer sk-edge-a"}
    assert p.post(headers=a).status_code == 200
    limited = p.post(headers=a)
    assert limited.status_code == 429 and SHED_HEADER not in limited.headers
    assert p.latch.refusal(("interactive", "Bearer sk-edge-a", "")) is None


# ---------------------------------------------------------------- a Serve proxy's bound
async def _until(condition: Any) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def test_the_ingress_states_its_bound_and_no_client_sees_it() -> None:
    """Every response of the ingress's app carries its door's bound (a 404 too: nothing need
    have been admitted); the edge, direct or a proxy's, drops it; a door with no stream
    bound states none."""
    ingress = _Ingress()
    stated = _post(ingress.app, "/not-a-route")
    assert stated.status_code == 404
    bound = parse_streams_header(stated.headers[STREAMS_HEADER])
    assert bound is not None and bound.bounds.interactive == 1 and not bound.keyed
    for edge in (
        EdgeGate(ingress.app, ROUTES, lambda: ingress.http_door),
        EdgeGate(ingress.app, ROUTES, lambda: None),
    ):
        assert STREAMS_HEADER not in _post(edge).headers
        assert STREAMS_HEADER not in _post(edge, "/not-a-route").headers

    unbounded = FrontDoor(FrontDoorSettings(), DoorRecord(), lambda n: None)
    http_door = HTTPDoor(APIGuard(APIConfig()), unbounded, _Counted())
    assert http_door.streams_header() is None
    app = DoorGate(Starlette(), ROUTES, lambda: http_door)
    assert STREAMS_HEADER not in _post(app, "/not-a-route").headers


def test_the_proxy_answers_for_a_full_door_from_its_bound() -> None:
    """The bound learnt from any response (here a 404's): while a stream through the proxy
    holds the door's one place, the next request gets the door's concurrency 429 (OpenAI
    body, Retry-After) from the proxy, the latch never closed, nothing reaching the door.
    The next request forwarded reports it (``proxy_edge``), and once the stream ends the
    next request is served."""
    p = _Proxy()

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=p.edge)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/v1/models")).status_code == 404
            p.ingress.hold = asyncio.Event()
            stream = asyncio.create_task(client.post("/v1/completions", content=b"{}"))
            await _until(lambda: p.ingress.reached)
            refused = await client.post("/v1/chat/completions", content=b"{}")
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["message"].startswith("overloaded (concurrency)")
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert len(p.ingress.reached) == 1 and p.ingress.record.sheds == []
            assert p.latch.refusal(("interactive", "", "")) is None  # answered by the bound
            p.ingress.hold.set()
            assert (await stream).status_code == 200
            p.ingress.hold = None
            assert (await client.post("/v1/completions", content=b"{}")).status_code == 200

    asyncio.run(scenario())
    assert p.ingress.record.sheds == ["proxy_edge"]
    assert p.edge.bound.in_flight == 0


def test_with_api_keys_the_bound_answers_only_callers_the_door_let_through() -> None:
    """A keyed ingress: the proxy answers from the bound only for a key the door has let
    through or refused for load; a wrong key still reaches the ingress and gets its 401."""
    p = _Proxy(api={"api_keys": ["sk-edge-a"]})
    a = {"authorization": "Bearer sk-edge-a"}

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=p.edge)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            p.ingress.hold = asyncio.Event()
            stream = asyncio.create_task(client.post("/v1/completions", headers=a))
            await _until(lambda: p.ingress.reached)
            # The key is not known yet: the door answers (and the latch closes on it).
            assert (await client.post("/v1/completions", headers=a)).status_code == 429
            assert p.ingress.record.sheds == ["concurrency"]
            p.clock.now += 0.1  # past the latch's hold, within the bound's
            assert (await client.post("/v1/completions", headers=a)).status_code == 429
            assert p.ingress.record.sheds == ["concurrency"]  # the proxy's answer
            wrong = await client.post("/v1/completions", headers={"authorization": "Bearer x"})
            assert wrong.status_code == 401
            p.ingress.hold.set()
            assert (await stream).status_code == 200

    asyncio.run(scenario())
    assert p.ingress.record.sheds == ["concurrency", "proxy_edge"]


def test_the_edge_bound_sums_replicas_and_refreshes_what_it_answers_by() -> None:
    """Two replicas' bounds add up; batch is unbounded when any replica leaves it so; the
    Retry-After is the mean stream's time over the streams in flight; a value that does not
    parse is ignored. A quiet spell forgets nothing, but once its bound is a second old one
    request a second goes to a door; a replica silent for the stale time while another
    answered no longer counts; a door that serves without a bound clears them all."""
    clock = _Clock()
    bound = EdgeBound(stale_s=10.0, refresh_s=1.0, clock=clock)
    assert bound.refusal("interactive", ("", "")) is None  # nothing heard
    bound.heard(streams_header("a", StreamBounds(2.0, 1.5, stream_s=4.0), keyed=False))
    bound.heard(streams_header("b", StreamBounds(3.0, None, stream_s=1.0), keyed=False))
    bound.heard("replica=c;interactive=lots")
    bound.in_flight = 4
    assert bound.refusal("interactive", ("", "")) is None  # 4 < 2 + 3
    bound.in_flight = 5
    shed = bound.refusal("interactive", ("", ""))
    assert shed is not None and shed.reason == "concurrency"
    assert shed.retry_after_s == 4.0 / 5
    assert bound.refusal("batch", ("", "")) is None  # b does not bound batch

    clock.now += 60  # quiet: still answered from the bound, but one request refreshes it
    assert bound.refusal("interactive", ("", "")) is None
    assert bound.refusal("interactive", ("", "")) is not None
    clock.now += 0.5
    assert bound.refusal("interactive", ("", "")) is not None
    clock.now += 0.5
    assert bound.refusal("interactive", ("", "")) is None

    bound.heard(streams_header("b", StreamBounds(3.0, None, stream_s=1.0), keyed=False))
    bound.in_flight = 3  # a is 60 s older than b's last word: only b's 3 count
    assert bound.refusal("interactive", ("", "")) is not None
    bound.unbounded()
    assert bound.refusal("interactive", ("", "")) is None
    with pytest.raises(ValueError, match="refresh_s"):
        EdgeBound(stale_s=1.0, refresh_s=2.0)


def test_parse_edge_report() -> None:
    assert parse_edge_report("interactive=12,batch=3") == {"interactive": 12, "batch": 3}
    assert parse_edge_report("interactive=2, interactive=1,urgent=9,batch=x,") == {"interactive": 3}


# ---------------------------------------------------------------- Serve's own errors
def _serve_like(status: int, text: str, headers: dict[str, str] | None = None) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await PlainTextResponse(text, status_code=status, headers=headers)(scope, receive, send)

    return app


def test_serves_plain_text_refusal_gets_the_openai_body() -> None:
    """Serve's queue bound answers "Request dropped due to backpressure" in plain text: the
    client gets the same status and Retry-After with the OpenAI error body."""
    app = _serve_like(429, "Request dropped due to backpressure", {"Retry-After": "2"})
    response = _post(EdgeGate(app, ROUTES, lambda: None))

    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {
        "error": {
            "message": "Request dropped due to backpressure",
            "type": "rate_limit_error",
            "param": None,
            "code": "429",
        }
    }
    assert int(response.headers["content-length"]) == len(response.content)

    unavailable = _post(EdgeGate(_serve_like(503, "draining"), ROUTES, lambda: None), "/x")
    assert unavailable.status_code == 503
    assert unavailable.json()["error"]["type"] == "server_error"


def test_other_responses_pass_as_they_are() -> None:
    """A successful plain-text response, a JSON error and a streamed body are untouched."""

    async def streamed(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in (b"data: 1\n\n", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def collect(app: Any) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def send(message: Any) -> None:
            sent.append(message)

        async def receive() -> Any:
            return {"type": "http.request", "body": b""}

        scope = {"type": "http", "method": "GET", "path": "/", "headers": []}
        await app(scope, receive, openai_error_bodies(send))
        return sent

    assert [m.get("body") for m in asyncio.run(collect(streamed))][1:] == [
        b"data: 1\n\n",
        b"data: 2\n\n",
        b"",
    ]
    ok = asyncio.run(collect(_serve_like(200, "fine")))
    assert ok[1]["body"] == b"fine"
    error = {"error": {"message": "bad", "type": "invalid_request_error"}}
    as_json = asyncio.run(collect(JSONResponse(error, status_code=400)))
    assert json.loads(as_json[1]["body"]) == error


def test_an_error_that_completes_does_not_open_the_latch() -> None:
    """Only a served response frees a place at the door: a 401 completing through the proxy
    leaves the latch closed for the keyed callers."""
    p = _Proxy(api={"api_keys": ["sk-edge-a"]})
    p.ingress.door.opened("interactive")
    a = {"authorization": "Bearer sk-edge-a"}
    assert p.post(headers=a).status_code == 429
    assert p.post(headers={"authorization": "Bearer sk-edge-wrong"}).status_code == 401
    sheds = list(p.ingress.record.sheds)
    assert p.post(headers=a).status_code == 429
    assert p.ingress.record.sheds == sheds  # answered by the proxy, not the door
