"""Prefix-aware routing: KV events from a real block pool reach a router's index, the decode
router sends a conversation back to the replica holding its prefix unless that replica is
overloaded, a single hot prefix spreads within the configured imbalance bound, the routers'
own history stands in while events lag, and the prefill router prices the tokens each
replica lacks."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from pdserve.deployments.kv_events import KVEventBatch, KVEventPublisher
from pdserve.deployments.messages import (
    GenerateRequest,
    PrefillRequest,
    ReplicaStats,
    SamplingOptions,
)
from pdserve.deployments.prefix_index import PrefixIndex, prompt_block_hashes
from pdserve.deployments.routers import DecodeRequestRouter, PrefillRequestRouter
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_events import KVEventLog
from tests.deployments.router_fakes import FakeReplica, ids, make_router, pending_request
from tests.deployments.serving_fakes import make_kv_target

BS = 16


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2048) for _ in range(n)]


def _pool_holding(prompt: list[int], log: KVEventLog) -> BlockPool:
    """A block pool that computed ``prompt`` and cached its full blocks."""
    pool = BlockPool(64, events=log)
    hashes = prompt_block_hashes(prompt, BS)
    blocks = pool.allocate(len(hashes))
    assert blocks is not None
    for block_id, h in zip(blocks, hashes, strict=True):
        pool.cache_block(block_id, h)
    pool.free(reversed(blocks))
    return pool


def _decode_stats(
    events: list[KVEventBatch] | None = None, running: int = 0, free: int = 100, seqs: int = 16
) -> dict[str, Any]:
    return ReplicaStats(
        role="decode", num_free_blocks=free, num_total_blocks=100, num_running=running,
        max_num_seqs=seqs, block_size=BS, kv_events=events or [],
    ).model_dump()  # fmt: skip


def test_events_from_a_block_pool_tell_the_index_which_prefix_a_replica_holds() -> None:
    prompt = _prompt(1, 100)  # 6 cacheable blocks
    log = KVEventLog()
    pool = _pool_holding(prompt, log)
    publisher = KVEventPublisher(log.drain, pool.cached_hashes, snapshot_every=1000)
    index = PrefixIndex(history_ttl_s=0)
    follow_up = prompt_block_hashes(prompt + [5] * 40, BS)  # the next turn: 8 blocks
    assert index.matched_blocks("a", follow_up) == 0
    index.apply("a", publisher.publish())
    assert index.matched_blocks("a", follow_up) == 6
    assert index.matched_blocks("b", follow_up) == 0
    # Another prompt takes the whole pool: the evictions reach the index as events.
    assert pool.allocate(64) is not None
    batches = publisher.publish()
    assert not batches[-1].snapshot and len(batches[-1].removed) == 6
    index.apply("a", batches)
    assert index.matched_blocks("a", follow_up) == 0


def test_a_lagging_router_recovers_from_the_published_window_and_snapshots() -> None:
    prompt = _prompt(2, 80)
    log = KVEventLog(max_pending=3)  # overflows: the next batch must be a snapshot
    pool = _pool_holding(prompt, log)
    publisher = KVEventPublisher(log.drain, pool.cached_hashes, window=2, snapshot_every=1000)
    publisher.publish()  # seq 0 (a snapshot), never seen by the router
    log.stored(123)
    log.stored(124)
    log.stored(125)
    log.stored(126)  # past max_pending: lost
    batches = publisher.publish()
    assert [b.seq for b in batches] == [0, 1] and batches[-1].snapshot
    index = PrefixIndex(history_ttl_s=0)
    index.apply("a", batches[-1:])
    assert index.matched_blocks("a", prompt_block_hashes(prompt, BS)) == 4


def test_decode_router_returns_a_conversation_to_the_replica_holding_it() -> None:
    async def run() -> None:
        prompt = _prompt(3, 200)
        log = KVEventLog()
        pool = _pool_holding(prompt, log)
        events = KVEventPublisher(log.drain, pool.cached_hashes).publish()
        router = make_router(DecodeRequestRouter, history_ttl_s=0.0)
        # "a" is a little busier, but holds the conversation so far.
        a = FakeReplica("a", _decode_stats(events, running=2))
        b = FakeReplica("b", _decode_stats(running=1))
        turn2 = GenerateRequest(request_id="t2", prompt_token_ids=prompt + [7] * 30)
        pending = pending_request(turn2, "i1")
        assert ids(await router.choose_replicas([b, a], pending))[0] == "a"
        assert router._prefix._reasons["i1"] == "prefix"
        other = GenerateRequest(request_id="o", prompt_token_ids=_prompt(4, 200))
        assert ids(await router.choose_replicas([b, a], pending_request(other, "i2")))[0] == "b"
        assert router._prefix._reasons["i2"] == "load"

        # Blind routing (prefix_aware off) ignores what "a" holds.
        blind = make_router(DecodeRequestRouter, prefix_aware=False)
        assert ids(await blind.choose_replicas([b, a], pending_request(turn2, "i3")))[0] == "b"

    asyncio.run(run())


def test_overload_and_kv_headroom_win_over_affinity() -> None:
    async def run() -> None:
        prompt = _prompt(5, 200)
        log = KVEventLog()
        pool = _pool_holding(prompt, log)
        events = KVEventPublisher(log.drain, pool.cached_hashes).publish()
        router = make_router(DecodeRequestRouter, history_ttl_s=0.0)
        turn2 = GenerateRequest(request_id="t", prompt_token_ids=prompt + [7] * 30)
        b = FakeReplica("b", _decode_stats(running=1))
        full = FakeReplica("a", _decode_stats(events, running=16))  # its batch is full
        assert ids(await router.choose_replicas([full, b], pending_request(turn2, "i1")))[0] == "b"
        assert router._prefix._reasons["i1"] == "overload"
        # 230 prompt + 16 output tokens: 16 blocks, 4 lacking on "a", which has 3 free.
        tight = FakeReplica("a", _decode_stats(events, running=0, free=3))
        assert ids(await router.choose_replicas([tight, b], pending_request(turn2, "i2")))[0] == "b"
        assert router._prefix._reasons["i2"] == "overload"

    asyncio.run(run())


def test_a_single_hot_prefix_spreads_within_the_imbalance_bound() -> None:
    """Every request shares one system prompt, which one replica holds: affinity sends them
    there until it runs ``max_imbalance`` requests ahead of the least-loaded replica, then
    load wins. With nothing completing, 40 requests over four replicas stay within it."""

    async def run() -> None:
        system = _prompt(6, 256)
        log = KVEventLog()
        pool = _pool_holding(system, log)
        events = KVEventPublisher(log.drain, pool.cached_hashes).publish()
        bound = 3
        router = make_router(DecodeRequestRouter, max_imbalance=bound, history_ttl_s=0.0)
        replicas = [FakeReplica("hot", _decode_stats(events, seqs=64))] + [
            FakeReplica(name, _decode_stats(seqs=64)) for name in ("x", "y", "z")
        ]
        for i in range(40):
            req = GenerateRequest(
                request_id=f"r{i}", prompt_token_ids=system + _prompt(100 + i, 20)
            )
            pending = pending_request(req, f"i{i}")
            chosen = ids(await router.choose_replicas(replicas, pending))[0]
            router.on_request_routed(pending, chosen, None)
        load = [router._inflight.get(r.replica_id, 0) for r in replicas]
        assert sum(load) == 40
        assert max(load) - min(load) <= bound + 1, load
        assert load[0] == max(load)  # affinity still pulled the most to the holder

    asyncio.run(run())


def test_the_routers_own_history_stands_in_while_events_lag() -> None:
    async def run() -> None:
        router = make_router(DecodeRequestRouter, history_ttl_s=60.0)
        a = FakeReplica("a", _decode_stats(running=1))
        b = FakeReplica("b", _decode_stats(running=1))
        prompt = _prompt(7, 200)
        first = pending_request(GenerateRequest(request_id="t1", prompt_token_ids=prompt), "i1")
        chosen = ids(await router.choose_replicas([a, b], first))[0]
        router.on_request_routed(first, chosen, None)
        router.on_request_completed(chosen, "i1")
        turn2 = GenerateRequest(request_id="t2", prompt_token_ids=prompt + [9] * 40)
        # Neither replica published events; the router remembers where turn 1 went.
        again = ids(await router.choose_replicas([b, a], pending_request(turn2, "i2")))[0]
        assert again == chosen

    asyncio.run(run())


def test_prefill_router_counts_only_the_tokens_a_replica_lacks() -> None:
    async def run() -> None:
        prompt = _prompt(8, 500)
        log = KVEventLog()
        pool = _pool_holding(prompt[:400], log)
        events = KVEventPublisher(log.drain, pool.cached_hashes).publish()

        def stats(queued: int, ev: list[KVEventBatch]) -> dict[str, Any]:
            return ReplicaStats(
                role="prefill", queued_prefill_tokens=queued, prefill_tokens_per_s=1000.0,
                kv_events=ev,
            ).model_dump()  # fmt: skip

        warm = FakeReplica("warm", stats(200, events))  # 200 tokens queued, holds 384
        cold = FakeReplica("cold", stats(0, []))
        req = PrefillRequest(
            request_id="p", prompt_token_ids=prompt, sampling=SamplingOptions(),
            kv_targets=(make_kv_target("p", 32),),
        )  # fmt: skip
        router = make_router(PrefillRequestRouter, history_ttl_s=0.0)
        assert (
            ids(await router.choose_replicas([cold, warm], pending_request(req, "i1")))[0] == "warm"
        )
        blind = make_router(PrefillRequestRouter, prefix_aware=False)
        assert (
            ids(await blind.choose_replicas([cold, warm], pending_request(req, "i2")))[0] == "cold"
        )

    asyncio.run(run())
