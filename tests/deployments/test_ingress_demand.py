"""The ingress's count of requests turned away for lack of decode capacity, reported to the
decode pool at most once a period (the autoscaling policy sizes decode by that demand)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.deployments.admission.front_door import TurnedAway


def test_capacity_sheds_are_reported_in_batches_at_most_once_a_period() -> None:
    counts = TurnedAway(period_s=1.0)
    assert counts.take(0.0) == 0  # nothing pending: no call
    counts.add()
    counts.add()
    assert counts.take(10.0) == 2  # the first report goes at once
    counts.add()
    assert counts.take(10.5) == 0  # within the period: kept for the next report
    counts.add(3)
    assert counts.take(11.0) == 4
    assert counts.pending == 0 and counts.take(20.0) == 0


class _FakeDecode:
    """The decode deployment handle: ``generate`` streams the given chunks;
    ``report_turned_away`` records what the ingress reported."""

    def __init__(self, chunks: list[Any], first_after_s: float = 0.0) -> None:
        self.chunks = chunks
        self.first_after_s = first_after_s
        self.reported: list[int] = []
        self.requests: list[Any] = []
        self.streams: list[_Stream] = []
        self.generate = self
        self.report_turned_away = _Report(self.reported)

    def options(self, **_: Any) -> _FakeDecode:
        return self

    def remote(self, request: Any) -> _Stream:
        self.requests.append(request)
        self.streams.append(_Stream(self.chunks, self.first_after_s))
        return self.streams[-1]


class _Stream:
    """Serve's response generator: the chunks, the first after ``first_after_s`` (the
    routing and the replica's decision)."""

    def __init__(self, chunks: list[Any], first_after_s: float = 0.0) -> None:
        self._chunks = list(chunks)
        self._delay_s = first_after_s
        self.cancelled = False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
            self._delay_s = 0.0
        if not self._chunks:
            raise StopAsyncIteration
        return self._chunks.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class _Report:
    def __init__(self, reported: list[int]) -> None:
        self.reported = reported

    async def remote(self, n: int) -> None:
        self.reported.append(n)


def _ingress(
    decode: _FakeDecode,
    shed_reasons: list[str],
    streams: Any = None,
    ack_within_s: float | None = None,
) -> Any:
    """An ``OpenAIIngress`` with only its door and decode calls (no Serve, no model)."""
    from pdserve.deployments.admission.front_door import FrontDoor, FrontDoorSettings
    from pdserve.deployments.ingress import OpenAIIngress, _door_pass_var
    from pdserve.deployments.migration import MigrationMetrics

    ingress = object.__new__(OpenAIIngress)
    metrics = SimpleNamespace(
        record_shed=lambda r, c: shed_reasons.append(r), record_streams=lambda n, limit: None
    )
    settings = FrontDoorSettings(
        ttft_slo_s=2.0 if streams else None,
        reject_within_s=ack_within_s or 0.1,
        admission_timeout=ack_within_s is not None,
    )
    ingress.__dict__.update(
        _decode=decode, _reports=set(), _late=set(), _max_migrations=0,
        _door_pass=_door_pass_var(),
        _migration_metrics=MigrationMetrics(model_name="m", replica="r", enabled=False),
    )  # fmt: skip
    ingress.door = FrontDoor(settings, metrics, ingress._report_turned_away, streams=streams)
    return ingress


def test_a_decode_shed_sheds_the_next_requests_at_the_door_and_they_are_reported() -> None:
    """The decode replica's 429 (its drain time as Retry-After) makes the ingress answer
    the next requests of that class 429 at its door (reason drain_hint) for that long, and
    those door sheds are reported to the decode pool as turned-away demand. The consumer
    stops at the error chunk, as the HTTP path does (DecodeStream.open raises it)."""
    from pdserve.deployments.admission.stream_limit import StreamLimit
    from pdserve.deployments.messages import GenerateChunk, GenerateRequest

    req = GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
    decode = _FakeDecode([GenerateChunk.overloaded(req, "overloaded (ttft_slo)", 5.0)])
    shed_reasons: list[str] = []
    streams = StreamLimit(target_s=2.0, high=16, initial=2)
    ingress = _ingress(decode, shed_reasons, streams)

    async def run() -> None:
        gen = ingress._generate(req)
        first = await anext(gen)  # the decode replica's 429
        assert first.error is not None and first.error.code == 429
        await gen.aclose()  # the consumer stops there
        # The replica's refusal cuts the door's stream bound (by half at most).
        assert streams.limit == 1 and ingress.door.num_open == 0
        for _ in range(3):  # within the 5 s drain time: shed at the door
            shed = ingress.door.check("interactive")
            assert shed is not None and "drain_hint" in shed.message, shed
            await asyncio.sleep(0)  # the background report runs

    asyncio.run(run())
    assert shed_reasons == ["drain_hint"] * 3
    # The first door shed is reported at once, the next two wait for the next period.
    assert decode.reported == [1] and ingress.door.turned_away.pending == 2


class _TwoReplicas(_FakeDecode):
    """A decode pool of replicas "a" and "b": each call goes to the replica named next in
    ``route`` and streams what that replica answers (a shed, or tokens)."""

    def __init__(self, route: list[str]) -> None:
        super().__init__([])
        self.route = route
        self.sheds: dict[str, float] = {}  # replica -> the drain time it sheds with
        self.served_by: list[str] = []

    def remote(self, request: Any) -> _Stream:
        from pdserve.deployments.messages import GenerateChunk

        replica = self.route.pop(0)
        self.requests.append(request)
        if replica in self.sheds:
            chunks = [
                GenerateChunk.overloaded(
                    request, "overloaded (ttft_slo)", self.sheds[replica], replica=replica
                )
            ]
        else:
            self.served_by.append(replica)
            chunks = [
                GenerateChunk(
                    request_id=request.request_id,
                    token_ids=[7],
                    finish_reason="length",
                    replica=replica,
                )
            ]
        self.streams.append(_Stream(chunks))
        return self.streams[-1]


def test_one_decode_replica_shedding_leaves_the_door_open_for_the_other() -> None:
    """Two decode replicas: while one sheds, requests are still let through at the door and
    served by the other; once both shed, the door answers 429 with Retry-After itself."""
    from pdserve.deployments.admission.stream_limit import StreamLimit
    from pdserve.deployments.messages import GenerateRequest
    from pdserve.deployments.openai_protocol import OpenAIError

    decode = _TwoReplicas(route=["b", "a", "b", "b"])
    shed_reasons: list[str] = []
    ingress = _ingress(decode, shed_reasons, StreamLimit(target_s=2.0, high=16, initial=16))

    async def call(n: int) -> list[Any]:
        with ingress._through_door("interactive"):  # raises the door's 429
            req = GenerateRequest(request_id=f"r{n}", prompt_token_ids=[1, 2, 3])
            return [chunk async for chunk in ingress._generate(req)]

    async def run() -> OpenAIError:
        assert [c.token_ids for c in await call(1)] == [[7]]  # served by b
        decode.sheds["a"] = 5.0
        shed = await call(2)  # routed to a, which sheds
        assert shed[0].error is not None and shed[0].error.code == 429
        # a sheds, b has room: the door lets the next request through, and b serves it.
        assert [c.token_ids for c in await call(3)] == [[7]]
        decode.sheds["b"] = 0.8
        await call(4)  # b sheds too: the whole pool is full
        with pytest.raises(OpenAIError) as refused:
            await call(5)
        return refused.value

    refused = asyncio.run(run())
    assert decode.served_by == ["b", "b"] and len(decode.requests) == 4  # r5 never sent
    assert refused.status_code == 429 and "drain_hint" in str(refused)
    assert refused.headers() == {"Retry-After": "1"}  # b's drain time, the first to free
    assert shed_reasons == ["drain_hint"]


def test_a_replica_shed_tells_the_client_when_the_pool_has_room_not_the_replica() -> None:
    """A replica's 429 carries its own drain time; the client gets the pool's: 5 s from a
    replica alone, but while the other replica has room (or drains sooner) the client may
    come back when that one can take it."""
    from pdserve.deployments.admission.rules import MIN_DRAIN_S
    from pdserve.deployments.admission.stream_limit import StreamLimit
    from pdserve.deployments.decode_stream import error_from_info
    from pdserve.deployments.messages import ErrorInfo, GenerateRequest

    decode = _TwoReplicas(route=["a", "b", "a", "b", "a"])
    ingress = _ingress(decode, [], StreamLimit(target_s=2.0, high=16, initial=16))

    async def retry_after(n: int) -> float | None:
        req = GenerateRequest(request_id=f"r{n}", prompt_token_ids=[1, 2, 3])
        chunks = [chunk async for chunk in ingress._generate(req)]
        return chunks[-1].error.retry_after_s if chunks[-1].error else None

    async def run() -> list[float | None]:
        decode.sheds["a"] = 5.0
        alone = await retry_after(1)  # a is the only replica the ingress knows
        assert await retry_after(2) is None  # b serves: now it is known
        beside_room = await retry_after(3)  # a sheds again while b has room
        decode.sheds["b"] = 0.8
        await retry_after(4)
        beside_full = await retry_after(5)  # a sheds while b drains in 0.8 s
        return [alone, beside_room, beside_full]

    alone, beside_room, beside_full = asyncio.run(run())
    assert alone == 5.0
    assert beside_room == MIN_DRAIN_S
    assert beside_full is not None and 0.7 < beside_full <= 0.8
    told = ErrorInfo(code=429, type="rate_limit_error", message="", retry_after_s=beside_room)
    assert error_from_info(told).headers() == {"Retry-After": "1"}  # the HTTP answer: not 5


def test_open_streams_at_the_adaptive_bound_are_shed_at_the_door_and_first_tokens_move_it() -> None:
    """The ingress holds its open streams under ``StreamLimit``: at the bound the next
    request is answered 429 at the door (reason concurrency, counted as turned-away demand);
    a stream's first token feeds the bound its TTFT, and a finished stream frees its slot."""
    from pdserve.deployments.admission.stream_limit import StreamLimit
    from pdserve.deployments.messages import GenerateChunk, GenerateRequest

    req = GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
    token = GenerateChunk(request_id="r1", token_ids=[7])
    last = GenerateChunk(request_id="r1", token_ids=[8], finish_reason="length")
    decode = _FakeDecode([token, last])
    shed_reasons: list[str] = []
    # A target no first token meets: every one comes late and cuts the bound.
    ingress = _ingress(decode, shed_reasons, StreamLimit(target_s=1e-9, high=16, initial=2))

    async def run() -> None:
        other = ingress.door.opened("interactive")  # a stream already open: a queue
        assert ingress.door.check("interactive") is None
        gen = ingress._generate(req)
        assert (await anext(gen)).token_ids == [7]
        assert ingress.door.num_open == 2
        assert ingress.door.streams.limit == pytest.approx(1.4)  # cut: 0.7 x the 2 in use
        shed = ingress.door.check("interactive")
        assert shed is not None and "concurrency" in shed.message, shed
        assert shed.retry_after_s > 0  # a drain time for Retry-After
        assert [c.token_ids async for c in gen] == [[8]]
        assert ingress.door.num_open == 1 and ingress.door.stream_s.value > 0
        assert ingress.door.check("interactive") is None  # the finished stream freed its slot
        ingress.door.closed(other, had_first_token=False)
        await asyncio.sleep(0)  # the background report runs

    asyncio.run(run())
    assert shed_reasons == ["concurrency"] and decode.reported == [1]  # turned-away demand


def test_a_request_the_decode_pool_does_not_take_in_time_is_answered_429_by_the_ingress() -> None:
    """Shedding on, the ingress asks the decode replica for an admission ack; when neither
    the ack nor the replica's own 429 comes within half of reject_within (Serve's routing or
    the replica's loop is the queue), the ingress answers 429 itself (reason
    admission_timeout), cuts its stream bound and counts the demand. The call is not
    cancelled while it may still be routed: the decode replica drops it past ``admit_by``,
    and one admitted just in time (its ack came late) is cancelled then."""
    from pdserve.deployments.admission.stream_limit import StreamLimit
    from pdserve.deployments.messages import GenerateChunk, GenerateRequest

    req = GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
    token = GenerateChunk(request_id="r1", token_ids=[7], finish_reason="length")
    decode = _FakeDecode([GenerateChunk.admitted(req), token], first_after_s=0.5)
    shed_reasons: list[str] = []
    streams = StreamLimit(target_s=2.0, high=16, initial=4)
    ingress = _ingress(decode, shed_reasons, streams, ack_within_s=0.1)

    async def run() -> list[GenerateChunk]:
        began = time.time()
        chunks = [chunk async for chunk in ingress._generate(req)]
        sent = decode.requests[0]
        assert sent.admit_by is not None and began < sent.admit_by < began + 0.1
        assert not decode.streams[0].cancelled  # not while it may still be routed
        await asyncio.sleep(0.6)  # its ack comes late: the admitted call is cancelled
        assert decode.streams[0].cancelled and not ingress._late
        return chunks

    chunks = asyncio.run(run())
    assert len(chunks) == 1 and chunks[0].error is not None
    assert chunks[0].error.code == 429 and "admission_timeout" in chunks[0].error.message
    assert (chunks[0].error.retry_after_s or 0) > 0
    assert shed_reasons == ["admission_timeout"] and ingress.door.turned_away.pending == 1
    assert streams.limit == 2 and ingress.door.num_open == 0  # cut like a refusal


def test_an_admitted_request_streams_without_the_ack() -> None:
    """The ack that came in time is the ingress's alone: the client's stream has the tokens."""
    from pdserve.deployments.admission.stream_limit import StreamLimit
    from pdserve.deployments.messages import GenerateChunk, GenerateRequest

    req = GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3], arrival_time=time.time())
    token = GenerateChunk(request_id="r1", token_ids=[7])
    last = GenerateChunk(request_id="r1", token_ids=[8], finish_reason="length")
    decode = _FakeDecode([GenerateChunk.admitted(req), token, last], first_after_s=0.01)
    shed_reasons: list[str] = []
    ingress = _ingress(decode, shed_reasons, StreamLimit(2.0, high=16), ack_within_s=0.5)

    async def run() -> list[GenerateChunk]:
        return [chunk async for chunk in ingress._generate(req)]

    assert [c.token_ids for c in asyncio.run(run())] == [[7], [8]]
    assert decode.requests[0].admit_by is not None and not decode.streams[0].cancelled
    assert shed_reasons == [] and ingress.door.num_open == 0


def test_the_turned_away_report_is_not_a_call_of_the_request_that_triggered_it() -> None:
    """A handle call takes its Serve request id from the caller's context, and Serve's
    router matches a routed call to its pending request by that id: a report sharing the id
    of the request whose door check sent it (that request's generate goes to the same
    pool) was orphaned in the router's backoff until its timeout, stalling the routing to
    the decode pool. The report runs in a fresh context: a request id of its own."""
    from ray.serve import context as serve_context

    ids: list[str] = []

    class _IdReport:
        async def remote(self, n: int) -> None:
            ids.append(serve_context._get_serve_request_context()._internal_request_id)

    decode = _FakeDecode([])
    decode.report_turned_away = _IdReport()
    ingress = _ingress(decode, [])

    async def run() -> None:
        serve_context._serve_request_context.set(
            serve_context._RequestContext(request_id="r1", _internal_request_id="internal-r1")
        )
        ingress.door.turned_away.add()
        ingress.door.check("interactive")  # sends the pending count
        await asyncio.gather(*ingress._reports)
        # The request's own context is untouched.
        assert serve_context._get_serve_request_context()._internal_request_id == "internal-r1"

    asyncio.run(run())
    assert len(ids) == 1 and ids[0] != "internal-r1"


def test_a_burst_arriving_together_opens_at_most_the_stream_bound() -> None:
    """Requests arriving together each pass the door, then wait on the loop (the body read,
    parsed and tokenized) before their decode call opens a stream: the door counts each
    from its check, so a burst of 12 opens 3 streams (the bound) and 9 get 429, and a
    request whose body turns out bad frees its place for the next one."""
    from pdserve.deployments.admission.stream_limit import StreamLimit
    from pdserve.deployments.messages import GenerateChunk, GenerateRequest
    from pdserve.deployments.openai_protocol import OpenAIError

    decode = _FakeDecode([GenerateChunk(request_id="r", token_ids=[7], finish_reason="length")])
    shed_reasons: list[str] = []
    ingress = _ingress(decode, shed_reasons, StreamLimit(target_s=2.0, high=16, initial=3))

    async def call(n: int, bad_body: bool = False) -> Any:
        try:
            with ingress._through_door("interactive"):
                await asyncio.sleep(0)  # the body is read: every arrival reaches the door
                if bad_body:
                    raise OpenAIError("bad body")
                req = GenerateRequest(request_id=f"r{n}", prompt_token_ids=[1, 2, 3])
                return [c.token_ids async for c in ingress._generate(req)]
        except OpenAIError as err:
            return err.status_code

    async def run() -> tuple[list[Any], Any]:
        burst = await asyncio.gather(*(call(n) for n in range(12)))
        assert ingress.door.num_open == ingress.door.num_passed == 0
        assert await call(12, bad_body=True) == 400
        return burst, await call(13)

    burst, after_bad_body = asyncio.run(run())
    assert burst.count([[7]]) == 3 and burst.count(429) == 9
    assert len(decode.requests) == 4 and after_bad_body == [[7]]
    assert shed_reasons == ["concurrency"] * 9


def test_the_decode_handle_is_used_once_while_the_ingress_starts() -> None:
    """Before any request, the starting ingress calls the decode pool once (a cheap read),
    so the first burst does not wait for the handle's router; a failing call is logged,
    not raised: the first request pays for it then."""
    from pdserve.deployments.handle_warmup import warm_up

    decode = _FakeDecode([])
    calls: list[str] = []

    class _Read:
        async def remote(self) -> int:
            calls.append("num_open_streams")
            return 0

    decode.num_open_streams = _Read()  # type: ignore[attr-defined]
    ingress = _ingress(decode, [])
    ingress._warmups = set()

    async def run() -> None:
        ingress._warm_decode()
        assert ingress._warmups  # running in the background
        await asyncio.gather(*ingress._warmups)

    asyncio.run(run())
    assert calls == ["num_open_streams"] and decode.requests == []

    async def broken() -> None:
        raise RuntimeError("no replica")

    assert asyncio.run(warm_up(broken, "decode", timeout_s=1.0)) is False
