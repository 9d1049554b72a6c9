"""``DoorGate``: the ingress's door answers a generate request before the app routes it,
with the OpenAI error body and Retry-After, and the requests it lets through reach the app
holding their place under the stream bound until the app is done with them."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pdserve.deployments.admission.front_door import DoorPass
from pdserve.deployments.api_guard import APIGuard
from pdserve.deployments.config import APIConfig
from pdserve.deployments.door_gate import DOOR_PASS_SCOPE_KEY, DoorGate, HTTPDoor
from tests.deployments.admission_fakes import DoorRecord, one_stream_door

ROUTES = ("/v1/completions", "/v1/chat/completions")


class _Counted:
    def __init__(self) -> None:
        self.responses: list[tuple[str, int]] = []

    def record_request(self, route: str, status: int, seconds: float) -> None:
        assert seconds >= 0
        self.responses.append((route, status))


class _Setup:
    """A door with a stream bound of one, the gate in front of an app that records what
    reaches it (and the door's state while it runs)."""

    def __init__(self, api: dict[str, Any] | None = None) -> None:
        self.record = DoorRecord()
        self.door = one_stream_door(self.record)
        self.counted = _Counted()
        self.http_door = HTTPDoor(APIGuard(APIConfig(**(api or {}))), self.door, self.counted)
        self.reached: list[tuple[str, bool, int]] = []  # path, held a pass, passes held

        async def endpoint(request: Request) -> JSONResponse:
            door_pass = request.scope.get(DOOR_PASS_SCOPE_KEY)
            held = isinstance(door_pass, DoorPass) and door_pass.held
            self.reached.append((request.url.path, held, self.door.num_passed))
            return JSONResponse({"body": (await request.body()).decode()})

        routes = [Route(p, endpoint, methods=["GET", "POST"]) for p in (*ROUTES, "/tokenize")]
        inner = Starlette(routes=routes)
        self.app = DoorGate(inner, ROUTES, lambda: self.http_door)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        async def send() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await client.post(path, content=b'{"prompt": "hi"}', **kwargs)

        return asyncio.run(send())


def test_a_closed_door_answers_429_with_the_openai_body_before_the_app() -> None:
    """An open stream fills the bound of one: the next generate request gets 429 with the
    OpenAI error body and a Retry-After, never reaching the app; the shed is recorded and
    counted under its route."""
    s = _Setup()
    s.door.opened("interactive")  # a stream holds the one place

    response = s.post("/v1/chat/completions")

    assert response.status_code == 429
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "429"
    assert error["message"].startswith("overloaded (concurrency)")
    assert int(response.headers["retry-after"]) >= 1
    assert s.reached == [] and s.record.sheds == ["concurrency"]
    assert s.counted.responses == [("/v1/chat/completions", 429)]


def test_a_request_let_through_reaches_the_app_holding_its_place_until_it_ends() -> None:
    s = _Setup()

    response = s.post("/v1/completions")

    assert response.status_code == 200 and response.json() == {"body": '{"prompt": "hi"}'}
    # While the app ran, the request held its pass (one place under the bound)...
    assert s.reached == [("/v1/completions", True, 1)]
    # ... and after it, nothing is held and the door is open again.
    assert s.door.num_passed == 0 and s.door.num_open == 0
    assert s.post("/v1/completions").status_code == 200
    assert s.counted.responses == []  # the app's responses are the route handler's to count


def test_other_routes_pass_untouched_while_the_door_is_closed() -> None:
    s = _Setup()
    s.door.opened("interactive")

    assert s.post("/tokenize").status_code == 200
    assert s.reached == [("/tokenize", False, 0)] and s.record.sheds == []


def test_the_callers_key_and_priority_are_checked_before_the_door() -> None:
    """A missing key is 401 and a bad priority header 400, each with the OpenAI body, and
    neither takes a place nor counts as a shed."""
    s = _Setup(api={"api_keys": ["sk-door-test"]})

    missing = s.post("/v1/completions")
    bad = s.post(
        "/v1/completions",
        headers={"authorization": "Bearer sk-door-test", "x-pdserve-priority": "urgent"},
    )
    ok = s.post("/v1/completions", headers={"authorization": "Bearer sk-door-test"})

    assert missing.status_code == 401 and missing.json()["error"]["type"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-pdserve-priority"
    assert ok.status_code == 200 and s.reached == [("/v1/completions", True, 1)]
    assert s.record.sheds == [] and s.door.num_passed == 0
    assert s.counted.responses == [("/v1/completions", 401), ("/v1/completions", 400)]
