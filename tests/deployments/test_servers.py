"""Prefill and decode servers in one process (no Ray): the real tiny engine on both sides,
the real shared-memory KV transfer between them, and the decode server's orchestration:
local vs remote prefill, fallback when the prefill side fails, cancellation, shedding."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pdserve.deployments.admission.rules import MIN_DRAIN_S
from pdserve.deployments.decode_server import DecodeServer
from pdserve.deployments.messages import GenerateChunk
from pdserve.deployments.prefill_server import PrefillServer
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from tests.deployments.in_process import (
    LONG_A,
    LONG_B,
    SHORT,
    behind,
    collect,
    config,
    long_prompt,
    request,
    tokens,
)
from tests.deployments.serving_fakes import InProcessPrefill
from tests.support import async_wait_until


@pytest.fixture(scope="module")
def model_dir() -> str:
    return config().model.resolve_path()


@pytest.fixture(scope="module")
def servers(model_dir: str) -> Iterator[tuple[DecodeServer, PrefillServer, InProcessPrefill]]:
    cfg = config()
    prefill = PrefillServer(cfg, model_dir)
    client = InProcessPrefill(prefill)
    decode = DecodeServer(cfg, model_dir, prefill=client)
    yield decode, prefill, client
    decode.shutdown()
    prefill.shutdown()


@pytest.fixture()
def pd(servers: tuple[DecodeServer, PrefillServer, InProcessPrefill]) -> Iterator[Any]:
    decode, prefill, client = servers
    client.reset()
    yield servers
    client.reset()
    assert_idle(decode, prefill)


def assert_idle(decode: DecodeServer, prefill: PrefillServer) -> None:
    """Both servers hold nothing: aborts and sends finish asynchronously on the engine
    threads, so this waits (bounded) for the reports to say idle before asserting it."""

    async def reports() -> tuple[Any, Any]:
        last: list[Any] = []

        async def idle() -> bool:
            last[:] = [await decode.check_integrity(), await prefill.check_integrity()]
            return last[0].idle and last[1].idle

        with contextlib.suppress(TimeoutError):
            await async_wait_until(idle, timeout=10, what="both servers idle")
        return last[0], last[1]

    d, p = asyncio.run(reports())
    assert d.idle, d
    assert p.idle, p


@pytest.fixture(scope="module")
def reference(model_dir: str) -> Callable[[list[int]], list[int]]:
    """Greedy outputs of a single plain engine."""
    engine = LLMEngine.from_pretrained(model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def expected(prompt: list[int]) -> list[int]:
        return engine.generate([prompt], greedy)[0].token_ids

    return expected


def test_local_and_remote_prefill_match_a_single_engine(
    pd: Any, reference: Callable[[list[int]], list[int]]
) -> None:
    decode, _, client = pd
    before = decode.counters()

    async def run() -> list[list[GenerateChunk]]:
        reqs = [
            request("s1", SHORT),
            request("l1", LONG_A),
            request("l2", LONG_B, admit_by=time.time() + 600),
        ]
        return await asyncio.gather(*(collect(decode, r) for r in reqs))

    short, long_a, acked = asyncio.run(run())
    # Asked for, the admission ack comes first and alone, before any token; else none.
    assert acked[0].ack and not acked[0].token_ids and acked[0].error is None
    assert not any(c.ack for c in short + long_a + acked[1:])
    long_b = acked[1:]
    assert tokens(short) == reference(SHORT)
    assert tokens(long_a) == reference(LONG_A)
    assert tokens(long_b) == reference(LONG_B)
    assert [c[0].prefill_location for c in (short, long_a, long_b)] == ["local", "remote", "remote"]
    # The ack and the first chunk name the replica (the ingress's door knows it routable).
    assert {acked[0].replica, short[0].replica, long_a[0].replica} == {decode.replica}
    assert decode.replica and all(c.replica is None for c in short[1:])
    assert long_a[-1].finish_reason == "length" and long_a[-1].num_prompt_tokens == 70
    # The chunk with the first token carries admission's prediction to the ingress, once.
    for chunks in (short, long_a, long_b):
        first = next(c for c in chunks if c.token_ids)
        assert first.predicted_ttft_s is not None and first.predicted_ttft_s > 0
        assert all(c.predicted_ttft_s is None for c in chunks if c is not first)
    assert "".join(c.text for c in long_a)  # text deltas stream too
    after = decode.counters()
    assert client.calls == 2
    assert (after.remote - before.remote, after.local - before.local) == (2, 1)
    # 70 + 45 prompt tokens -> 5 + 3 blocks of KV, every layer, K and V.
    expected = (5 + 3) * decode.kv_bytes_per_token * decode.block_size
    assert after.kv_bytes_received - before.kv_bytes_received == expected


def test_a_follow_up_turn_moves_only_the_blocks_the_decode_side_lacks(
    pd: Any, reference: Callable[[list[int]], list[int]]
) -> None:
    """Turn 2 repeats turn 1 and its answer: the decode replica keeps the 5 blocks it
    cached (70 prompt + 10 output tokens), the prefill replica computes past the 4 it
    cached (turn 1's prompt), 3 blocks cross, and the client sees the prefill's hit."""
    decode, _, client = pd
    turn1 = long_prompt(31, 70)
    first = asyncio.run(collect(decode, request("c1", turn1)))
    assert first[0].prefill_location == "remote"
    turn2 = turn1 + tokens(first) + long_prompt(32, 40)  # 122 tokens: 8 blocks
    before = decode.counters()
    second = asyncio.run(collect(decode, request("c2", turn2)))
    assert second[0].prefill_location == "remote"
    assert tokens(second) == reference(turn2)
    after = decode.counters()
    moved = after.kv_bytes_received - before.kv_bytes_received
    assert moved == 3 * decode.kv_bytes_per_token * decode.block_size
    assert second[-1].num_cached_tokens == 4 * decode.block_size


@pytest.mark.parametrize("failure", ["replica_died", "deadline_missed"])
def test_failed_remote_prefill_recomputes_locally(
    pd: Any, reference: Callable[[list[int]], list[int]], failure: str
) -> None:
    decode, _, client = pd
    if failure == "replica_died":
        client.fail = RuntimeError("ActorDiedError: the prefill replica died")
    else:
        client.delay_s = 30.0  # far past the 3 s transfer deadline
    before = decode.counters()
    prompt = long_prompt(3 if failure == "replica_died" else 4, 50)
    chunks = asyncio.run(collect(decode, request(f"f-{failure}", prompt)))
    assert tokens(chunks) == reference(prompt)
    assert chunks[0].prefill_location == "fallback"
    assert all(c.error is None for c in chunks)
    assert decode.counters().fallbacks == before.fallbacks + 1
    if failure == "deadline_missed":
        assert client.cancelled == 1  # the stalled call was cancelled, not left running


def test_queued_remote_prefill_gets_its_predicted_time_before_any_fallback(
    pd: Any, reference: Callable[[list[int]], list[int]]
) -> None:
    """A prefill pool that is merely busy answers later than ``timeout_s`` (3 s here); the
    decode replica predicted that from its measured rate and waits instead of recomputing
    the prompt itself (which would stall its decode batch)."""
    decode, _, client = pd
    estimate = decode.remote_estimate
    saved = estimate.tokens_per_s
    estimate.tokens_per_s = 10.0  # 50 tokens -> a predicted 5 s on the prefill pool
    client.delay_s = 3.5  # past the 3 s slack alone, well inside prediction + slack
    before = decode.counters()
    prompt = long_prompt(9, 50)
    try:
        chunks = asyncio.run(collect(decode, request("queued", prompt)))
    finally:
        estimate.tokens_per_s = saved
    assert tokens(chunks) == reference(prompt)
    assert chunks[0].prefill_location == "remote"
    after = decode.counters()
    assert (after.fallbacks, after.remote) == (before.fallbacks, before.remote + 1)


def test_client_disconnect_mid_stream_frees_blocks_on_both_sides(pd: Any) -> None:
    decode, _, _ = pd

    async def run() -> list[GenerateChunk]:
        got = []
        gen = decode.generate(request("cancel-stream", long_prompt(5, 60), max_tokens=200))
        async with contextlib.aclosing(gen):
            async for chunk in gen:
                got.append(chunk)
                if len(tokens(got)) >= 3:
                    break  # the client went away
        return got

    got = asyncio.run(run())
    assert got[0].prefill_location == "remote" and got[-1].finish_reason is None
    # the pd fixture asserts both servers are idle: no blocks, transfers or streams held


def test_cancel_while_prefill_is_in_flight(pd: Any) -> None:
    decode, prefill, client = pd
    client.delay_s = 30.0  # the prefill call stalls until the cancellation ends it

    async def run() -> None:
        prompt = long_prompt(6, 60)
        task = asyncio.create_task(collect(decode, request("cancel-prefill", prompt)))
        await async_wait_until(
            lambda: client.calls == 1, timeout=30, what="the remote prefill call to start"
        )
        assert decode.remote.pending() == ["cancel-prefill"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert client.cancelled == 1
    assert decode.remote.pending() == []


def test_invalid_request_gets_an_error_chunk(pd: Any) -> None:
    decode, _, _ = pd
    too_long = [5] * 5000  # longer than the 64-block pool can ever hold
    chunks = asyncio.run(collect(decode, request("too-long", too_long)))
    assert len(chunks) == 1 and chunks[0].error is not None
    assert chunks[0].error.code == 400 and "max_model_len" in chunks[0].error.message


def test_an_idle_replica_serves_prompts_whose_own_prefill_misses_the_slo(model_dir: str) -> None:
    """One request at a time, each longer, on a replica whose TTFT objective no prompt can
    meet: nothing is queued ahead of any of them, so a shed could only be shed again at
    every retry. Each is served (and counted past its SLO), none is shed."""
    cfg = config(slo={"ttft_ms": 0.01}, admission={"on_slo_miss": "shed"})
    decode = DecodeServer(cfg, model_dir, prefill=None)
    try:
        for i, n in enumerate((7, 200, 900)):
            req = request(f"alone-{i}", long_prompt(40 + i, n), max_tokens=2)
            chunks = asyncio.run(collect(decode, req))
            assert chunks[-1].error is None and chunks[-1].finish_reason == "length", chunks[-1]
        assert decode.counters().shed == 0
    finally:
        decode.shutdown()


def test_shedding_when_no_placement_meets_the_slo(model_dir: str) -> None:
    cfg = config(
        slo={"ttft_ms": 0.01}, admission={"on_slo_miss": "shed", "batch_on_slo_miss": "queue"}
    )
    decode = DecodeServer(cfg, model_dir, prefill=None)
    try:
        # The batch request (which queues) runs first: it gives the engine a measured
        # prefill rate, and a prediction from the configured prior alone never sheds.
        batch = asyncio.run(collect(decode, request("batch", SHORT, priority="batch")))
        assert batch[-1].finish_reason == "length" and batch[0].prefill_location == "local"
        # One the ingress answered 429 already (no decision by its admit_by): no work.
        before = decode.counters()
        late = asyncio.run(collect(decode, request("late", SHORT, admit_by=time.time() - 1)))
        assert len(late) == 1 and late[0].error is not None and late[0].error.code == 429
        assert decode.counters() == before
        shed_me = request("shed-me", LONG_A, admit_by=time.time() + 600)
        shed = asyncio.run(behind(decode, request("ahead", SHORT, priority="batch"), shed_me))
        assert len(shed) == 1 and shed[0].error is not None and not shed[0].ack
        assert shed[0].error.code == 429  # with the predicted drain time, not a constant
        assert shed[0].replica == decode.replica  # the ingress's door tracks it per replica
        assert (shed[0].error.retry_after_s or 0) >= MIN_DRAIN_S
        assert decode.counters().shed == 1
    finally:
        decode.shutdown()
