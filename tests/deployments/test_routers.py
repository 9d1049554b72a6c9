"""Request routers: ranking by predicted TTFT (prefill) and by KV headroom/batch (decode)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.deployments.messages import (
    GenerateRequest,
    PrefillRequest,
    ReplicaStats,
    SamplingOptions,
)
from pdserve.deployments.routers import (
    DecodeRequestRouter,
    DecodeRouterParams,
    PrefillRequestRouter,
    PrefillRouterParams,
    predict_prefill_ttft_s,
    rank_decode,
    rank_prefill,
)
from tests.deployments.router_fakes import FakeReplica, ids, make_router, pending_request
from tests.deployments.serving_fakes import make_kv_target


def prefill_stats(queued: int, rate: float, kv_bytes: int = 0) -> dict[str, Any]:
    return ReplicaStats(
        role="prefill", queued_prefill_tokens=queued, prefill_tokens_per_s=rate,
        kv_bytes_per_token=kv_bytes,
    ).model_dump()  # fmt: skip


def decode_stats(free: int, total: int, running: int, max_seqs: int = 8) -> dict[str, Any]:
    return ReplicaStats(
        role="decode", num_free_blocks=free, num_total_blocks=total, num_running=running,
        max_num_seqs=max_seqs, kv_usage=1 - free / total, block_size=16,
    ).model_dump()  # fmt: skip


def test_prefill_ttft_prediction_adds_queue_prompt_and_transfer() -> None:
    p = PrefillRouterParams(default_prefill_tokens_per_s=500.0, transfer_bytes_per_s=1e6)
    stats = ReplicaStats.model_validate(prefill_stats(queued=1000, rate=1000.0, kv_bytes=2000))
    # (1000 queued + 500 prompt) / 1000 tok/s + 500 tok * 2000 B / 1e6 B/s
    assert predict_prefill_ttft_s(stats, 0, 500, p) == pytest.approx(1.5 + 1.0)
    # A replica without stats yet uses the default rate; in-flight tokens count as queue.
    assert predict_prefill_ttft_s(None, 250, 250, p) == pytest.approx(1.0)


def test_prefill_rank_prefers_fast_replica_over_short_queue() -> None:
    p = PrefillRouterParams()
    slow_empty = FakeReplica("slow", prefill_stats(queued=0, rate=100.0))
    fast_busy = FakeReplica("fast", prefill_stats(queued=2000, rate=10_000.0))
    mid = FakeReplica("mid", prefill_stats(queued=500, rate=1000.0))
    # slow: 5 s, fast: 0.25 s, mid: 1 s for a 500-token prompt
    assert ids(rank_prefill([slow_empty, fast_busy, mid], 500, {}, p)) == ["fast", "mid", "slow"]


def test_prefill_rank_counts_tokens_it_routed_before_stats_caught_up() -> None:
    p = PrefillRouterParams()
    a = FakeReplica("a", prefill_stats(queued=0, rate=1000.0))
    b = FakeReplica("b", prefill_stats(queued=100, rate=1000.0))
    assert ids(rank_prefill([a, b], 100, {}, p))[0] == "a"
    assert ids(rank_prefill([a, b], 100, {"a": 800}, p))[0] == "b"


def test_decode_rank_puts_replicas_without_room_last() -> None:
    p = DecodeRouterParams()
    full = FakeReplica("full", decode_stats(free=2, total=100, running=0))
    busy = FakeReplica("busy", decode_stats(free=50, total=100, running=6))
    light = FakeReplica("light", decode_stats(free=80, total=100, running=1))
    assert ids(rank_decode([full, busy, light], 10, {}, p)) == ["light", "busy", "full"]


def test_decode_rank_weights_choose_between_kv_and_batch() -> None:
    kv_heavy = FakeReplica("kv_heavy", decode_stats(free=20, total=100, running=1))
    batch_heavy = FakeReplica("batch_heavy", decode_stats(free=90, total=100, running=7))
    both = [kv_heavy, batch_heavy]
    assert ids(rank_decode(both, 1, {}, DecodeRouterParams(1.0, 0.0)))[0] == "batch_heavy"
    assert ids(rank_decode(both, 1, {}, DecodeRouterParams(0.0, 1.0)))[0] == "kv_heavy"


def test_malformed_stats_are_treated_as_unknown() -> None:
    odd = FakeReplica("odd", {"role": "prefill", "queued_prefill_tokens": "lots"})
    known = FakeReplica("known", prefill_stats(queued=10_000, rate=1000.0))
    assert ids(rank_prefill([known, odd], 10, {}, PrefillRouterParams()))[0] == "odd"


def test_prefill_router_tracks_what_it_routed_until_completion() -> None:
    async def run() -> None:
        # Prefix-blind: the same prompt routed again would otherwise follow its prefix.
        router = make_router(
            PrefillRequestRouter, default_prefill_tokens_per_s=1000.0, prefix_aware=False
        )
        a = FakeReplica("a", prefill_stats(queued=0, rate=1000.0))
        b = FakeReplica("b", prefill_stats(queued=300, rate=1000.0))
        req = PrefillRequest(
            request_id="r1", prompt_token_ids=list(range(500)),
            sampling=SamplingOptions(), kv_targets=(make_kv_target("r1", 32),),
        )  # fmt: skip
        pending = pending_request(req, "i1")
        tiers = await router.choose_replicas([a, b], pending)
        assert ids(tiers) == ["a", "b"]
        assert pending.routing_context.should_backoff  # no tight loop when all are full
        router.on_request_routed(pending, "a", None)
        tiers = await router.choose_replicas([a, b], pending_request(req, "i2"))
        assert ids(tiers) == ["b", "a"]  # a now holds 500 routed tokens
        router.on_request_completed("a", "i1")
        assert ids(await router.choose_replicas([a, b], pending_request(req, "i3"))) == ["a", "b"]

    asyncio.run(run())


def test_decode_router_sizes_the_request_in_blocks() -> None:
    async def run() -> None:
        router = make_router(DecodeRequestRouter, kv_weight=1.0, batch_weight=1.0)
        roomy = FakeReplica("roomy", decode_stats(free=40, total=100, running=4))
        tight = FakeReplica("tight", decode_stats(free=5, total=100, running=0))
        small = GenerateRequest(
            request_id="s", prompt_token_ids=[1] * 16, sampling=SamplingOptions(max_tokens=16)
        )
        big = GenerateRequest(
            request_id="b", prompt_token_ids=[1] * 200, sampling=SamplingOptions(max_tokens=100)
        )
        assert (
            ids(await router.choose_replicas([roomy, tight], pending_request(small, "1")))[0]
            == "tight"
        )
        # 300 tokens = 19 blocks: only "roomy" has room.
        assert (
            ids(await router.choose_replicas([roomy, tight], pending_request(big, "2")))[0]
            == "roomy"
        )

    asyncio.run(run())


def test_router_books_every_call_of_a_request_id() -> None:
    """Serve names a call by the request it is made from: the choices of one request
    (``n`` > 1) reach the decode router under one id. Each is booked until its own
    completion, on the replica it went to; none is lost or left behind."""

    async def run() -> None:
        router = make_router(DecodeRequestRouter, kv_weight=0.0, batch_weight=1.0)
        a = FakeReplica("a", decode_stats(free=100, total=100, running=0))
        b = FakeReplica("b", decode_stats(free=100, total=100, running=0))
        req = GenerateRequest(request_id="r", prompt_token_ids=[1] * 16)
        for replica in ("a", "b", "a"):  # three choices, one id
            router.on_request_routed(pending_request(req, "i1"), replica, None)
        assert router._inflight == {"a": 2, "b": 1}
        router.on_request_completed("b", "i1")
        assert router._inflight == {"a": 2}
        router.on_request_completed("c", "i1")  # rejected there, never booked: no change
        assert router._inflight == {"a": 2}
        assert ids(await router.choose_replicas([a, b], pending_request(req, "i2")))[0] == "b"
        router.on_request_completed("a", "i1")
        router.on_request_completed("a", "i1")
        router.on_request_completed("a", "i1")  # one completion too many: ignored
        assert router._inflight == {}

    asyncio.run(run())
