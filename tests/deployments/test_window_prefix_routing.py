"""Routing for a model whose window layers keep a pool of their own.

Prefix affinity: a replica uses a prefix hit only while its window pool holds the hit's
window, so the routers' index, fed both pools' KV events, credits each replica with the hit
its engine really takes: equal to the engine's own ``cached_prefix_tokens`` and to the
``num_cached_tokens`` the request then reports, and between a replica holding a long prefix
whose window it evicted and one holding a shorter usable prefix, the decode router picks the
one whose hit is longer in fact.

Transfer estimate: a hand-off moves the full layers' KV of every token the decode side
lacks but the window layers' only for the first decoded token's window (gpt-oss-20b, 4,096
tokens: 99 MiB, not the 192 MiB of every layer), and the prefill router ranks by that.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from pdserve.deployments import kv_events
from pdserve.deployments.handoff_bytes import handoff_bytes, handoff_window_tokens
from pdserve.deployments.kv_events import KVEventBatch, KVEventPublisher
from pdserve.deployments.messages import (
    GenerateRequest,
    PrefillRequest,
    ReplicaStats,
    SamplingOptions,
)
from pdserve.deployments.prefix_index import PrefixIndex, prompt_block_hashes
from pdserve.deployments.routers import DecodeRequestRouter, PrefillRequestRouter
from pdserve.deployments.tp_kv import replica_kv_bytes_per_token
from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from tests.deployments.router_fakes import FakeReplica, ids, make_router, pending_request
from tests.deployments.serving_fakes import make_kv_target
from tests.engine.transformers_reference import make_prompt, tiny_models_fixture
from tests.engine.window_events import B, LoggedWindowManager

MiB = 1 << 20
gpt_oss = tiny_models_fixture({"gpt-oss": ("gpt-oss", {"swiglu_limit": 1.5})}, "window-route")


def _publisher(m: LoggedWindowManager) -> KVEventPublisher:
    return KVEventPublisher(
        m.drain,
        m.kv.pool.cached_hashes,
        window_snapshot=m.window.pool.cached_hashes,
        window_blocks=m.window.hit_blocks,
    )


def _engine_hit(m: LoggedWindowManager, prompt: list[int]) -> int:
    probe = Request("probe", prompt, SamplingParams(max_tokens=1), 0.0)
    return m.kv.get_computed_blocks(probe)[1]


def _without_window(batches: list[KVEventBatch]) -> list[KVEventBatch]:
    """What a router indexing only the full pool's events knew."""
    return [b.model_copy(update={"window_blocks": 0}) for b in batches]


def test_the_decode_router_picks_the_hit_the_engine_really_takes() -> None:
    """Window 32 (a hit needs its last 2 blocks), 5 usable window blocks. "long" computed a
    200-token conversation: it holds all 12 full blocks but only blocks 8..11 of the window
    pool. "short" computed its first 100 tokens: 6 blocks, their window blocks all cached. A
    request sharing the first 150 tokens hits 9 blocks of "long"'s full pool, none usable;
    "short" reuses 6 blocks."""
    conversation = list(range(1000, 1200))
    long, short = LoggedWindowManager(32, 6), LoggedWindowManager(32, 6)
    long_events = _publisher(long)
    long_events.publish()  # seq 0: an empty snapshot; the next batch carries the events
    long.compute("a", conversation, chunk=16)
    short.compute("b", conversation[:100], chunk=16)
    batches = {"long": long_events.publish(), "short": _publisher(short).publish()}
    assert not batches["long"][-1].snapshot and batches["long"][-1].window_removed
    request = conversation[:150] + [7] * 30
    hashes = prompt_block_hashes(request, B)

    index, full_only = PrefixIndex(history_ttl_s=0), PrefixIndex(history_ttl_s=0)
    for name, m in (("long", long), ("short", short)):
        index.apply(name, batches[name])
        full_only.apply(name, _without_window(batches[name]))
        assert index.matched_blocks(name, hashes) * B == _engine_hit(m, request)
    assert full_only.matched_blocks("long", hashes) == 9 > index.matched_blocks("long", hashes)
    assert index.matched_blocks("short", hashes) == 6

    def stats(name: str, events: list[KVEventBatch]) -> dict[str, Any]:
        return ReplicaStats(
            role="decode", num_free_blocks=100, num_total_blocks=100, max_num_seqs=16,
            block_size=B, kv_events=events,
        ).model_dump()  # fmt: skip

    async def choose(events: dict[str, list[KVEventBatch]]) -> str:
        router = make_router(DecodeRequestRouter, history_ttl_s=0.0)
        replicas = [FakeReplica(name, stats(name, events[name])) for name in ("long", "short")]
        pending = pending_request(GenerateRequest(request_id="r", prompt_token_ids=request), "i")
        return ids(await router.choose_replicas(replicas, pending))[0]

    assert asyncio.run(choose(batches)) == "short"
    blind = {name: _without_window(b) for name, b in batches.items()}
    assert asyncio.run(choose(blind)) == "long"  # the full pool alone misleads


def test_the_routers_history_holds_only_the_window_a_prefill_leaves() -> None:
    """Before events arrive, a prompt this router sent to a window-pool replica counts for
    a later prompt extending it, not for one sharing only its start (whose window the
    prefill released as it passed)."""
    now = [0.0]
    index = PrefixIndex(history_ttl_s=60.0, clock=lambda: now[0])
    index.apply("r", [KVEventBatch(seq=0, snapshot=True, window_blocks=2)])
    prompt = list(range(500, 820))  # 19 cacheable blocks
    index.routed("r", prompt_block_hashes(prompt, B))
    assert index.matched_blocks("r", prompt_block_hashes(prompt + [3] * 40, B)) == 19
    assert index.matched_blocks("r", prompt_block_hashes(prompt[:160] + [3] * 40, B)) == 0
    now[0] = 61.0  # the history expired
    assert index.matched_blocks("r", prompt_block_hashes(prompt + [3] * 40, B)) == 0


def test_a_replicas_published_hits_are_the_hits_its_requests_report(gpt_oss) -> None:
    """Tiny gpt-oss (window 32) with one seat and 32-token chunks (a window pool of 7
    blocks) served a 300-token prompt. For follow-ups sharing 40..300 of its tokens, the
    index fed the replica's published events predicts the engine's hit exactly; the
    follow-ups then report those cached tokens, including one whose prefix the full pool
    holds but whose window was evicted (no hit, where the full pool alone claims one)."""
    model_dir, ref = gpt_oss
    config = EngineConfig(model=str(model_dir), max_num_seqs=1, max_num_batched_tokens=32)
    engine = AsyncLLMEngine(LLMEngine(config))
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def cached_tokens(rid: str, prompt: list[int]) -> int:
        outs = [o async for o in engine.generate(rid, prompt, greedy)]
        return outs[-1].num_cached_tokens

    try:
        publisher = kv_events.publisher_for(engine)
        assert publisher is not None
        first = make_prompt(300, seed=51, vocab=ref.vocab_size)
        asyncio.run(cached_tokens("first", first))
        batches = publisher.publish()
        index, full_only = PrefixIndex(history_ttl_s=0), PrefixIndex(history_ttl_s=0)
        index.apply("r", batches)
        full_only.apply("r", _without_window(batches))
        tail = make_prompt(20, seed=52, vocab=ref.vocab_size)
        predicted = {}
        for shared in range(40, 301, 20):
            prompt = first[:shared] + tail
            predicted[shared] = index.matched_blocks("r", prompt_block_hashes(prompt, B)) * B
            assert predicted[shared] == engine.cached_prefix_tokens(prompt), shared
        assert predicted[300] == 288
        assert asyncio.run(cached_tokens("long", first + tail)) == 288
        # Serving it changed both pools: the next prediction comes from the next batch.
        later = publisher.publish()
        index.apply("r", later)
        full_only.apply("r", _without_window(later))
        short = first[:100] + tail
        hashes = prompt_block_hashes(short, B)
        assert index.matched_blocks("r", hashes) == 0 < full_only.matched_blocks("r", hashes)
        assert asyncio.run(cached_tokens("short", short)) == 0
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------- transfer estimate


def _bytes_per_token(layers: int, kv_heads: int, head_dim: int) -> int:
    """One token's KV over ``layers`` layers of a bf16 pool ``[L, 2, N, B, Hkv, D]``."""
    pool = torch.empty((layers, 2, 1, B, kv_heads, head_dim), dtype=torch.bfloat16, device="meta")
    return replica_kv_bytes_per_token(pool, kv_heads)


def test_a_hand_off_moves_the_window_layers_for_the_window_only() -> None:
    """docs/models.md's hand-off table: gpt-oss-20b (12 full + 12 window layers, 8 KV heads
    of 64, window 128) and Gemma 3 1B (4 full + 22 window, 1 KV head of 256, window 512)."""
    gpt = _bytes_per_token(12, 8, 64)
    assert handoff_bytes(4096, 4096, gpt, gpt, 128, B) == 99 * MiB
    assert handoff_bytes(2048, 2048, gpt, gpt, 128, B) == 51 * MiB
    assert handoff_bytes(4096, 4096, 2 * gpt) == 192 * MiB  # every layer, every token
    gemma_full, gemma_window = _bytes_per_token(4, 1, 256), _bytes_per_token(22, 1, 256)
    assert handoff_bytes(4096, 4096, gemma_full, gemma_window, 512, B) == 27 * MiB
    assert handoff_bytes(2048, 2048, gemma_full, gemma_window, 512, B) == 19 * MiB
    # The window's blocks, not tokens: 300 tokens, window 32, from block (300 - 31) // 16.
    assert handoff_window_tokens(300, 300, 32, B) == 300 - 16 * 16
    # A delta hand-off (the decode side holds all but the last 50 tokens) and a short prompt.
    assert handoff_window_tokens(4096, 50, 128, B) == 50
    assert handoff_window_tokens(9, 9, 32, B) == 9


def test_the_prefill_router_ranks_by_the_windowed_hand_off() -> None:
    """Two prefill replicas of gpt-oss-20b: "windowed" keeps a window pool and hands off
    99 MiB for a 4,096-token prompt, "plain" 192 MiB; at 1 GB/s that is 98 ms, which is
    worth more than the 60 queued tokens (60 ms) "windowed" has ahead of it."""
    gpt = _bytes_per_token(12, 8, 64)

    def stats(queued: int, window: bool) -> dict[str, Any]:
        return ReplicaStats(
            role="prefill", queued_prefill_tokens=queued, prefill_tokens_per_s=1000.0,
            kv_bytes_per_token=2 * gpt, window_kv_bytes_per_token=gpt if window else 0,
            kv_window=128 if window else 0, block_size=B,
        ).model_dump()  # fmt: skip

    prompt = list(range(4, 4100))
    req = PrefillRequest(
        request_id="p", prompt_token_ids=prompt, sampling=SamplingOptions(),
        kv_targets=(make_kv_target("p", 256),),
    )  # fmt: skip

    async def choose(windowed: FakeReplica, plain: FakeReplica, **kwargs: Any) -> str:
        router = make_router(PrefillRequestRouter, history_ttl_s=0.0, **kwargs)
        return ids(await router.choose_replicas([plain, windowed], pending_request(req, "i")))[0]

    for prefix_aware in (True, False):
        windowed = FakeReplica("windowed", stats(60, window=True))
        plain = FakeReplica("plain", stats(0, window=False))
        assert asyncio.run(choose(windowed, plain, prefix_aware=prefix_aware)) == "windowed"
        unaware = FakeReplica("windowed", stats(60, window=False))
        assert asyncio.run(choose(unaware, plain, prefix_aware=prefix_aware)) == "plain"
