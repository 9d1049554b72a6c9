"""Prefill and decode servers of a window model (a tiny gpt-oss, window 32, block 16) in one
process, no Ray: the real engines on both sides, the real shared-memory hand-off. Both
replicas keep the window pool; a prompt far longer than the window moves every block of the
full layer and only the first decoded token's window of the window layer, and the tokens
equal one engine's. A failed remote prefill, and a peer that keeps no window pool (either
side), end in a local recompute with the same tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdserve.deployments.decode_server import DecodeServer
from pdserve.deployments.engine_factory import EngineHooks, default_engine_factory
from pdserve.deployments.messages import PrefillRequest, SamplingOptions
from pdserve.deployments.prefill_server import PrefillServer
from pdserve.deployments.window_handoff import WindowPairingError
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.deployments.in_process import collect, config, long_prompt, request, tokens
from tests.deployments.serving_fakes import InProcessPrefill, make_kv_target
from tests.deployments.window_servers import (
    WINDOW,
    check_failed_prefill_is_recomputed,
    greedy_tokens,
    integrity,
    tiny_window_model,
)

MAX_TOKENS = 12


def no_window_pool(config: EngineConfig, hooks: EngineHooks) -> Any:
    """A replica whose engine keeps every block of the window layers in its one pool (as
    one built by another pdserve version, or with ``window_kv_pool=False``)."""
    return default_engine_factory(config.model_copy(update={"window_kv_pool": False}), hooks)


@dataclass
class Replicas:
    prefill: PrefillServer  # window pool
    plain_prefill: PrefillServer  # no window pool
    decode: DecodeServer  # window pool
    plain_decode: DecodeServer  # no window pool, paired with ``prefill``
    client: InProcessPrefill  # ``decode``'s
    reference: LLMEngine  # one engine, window pool on


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    model_dir = tiny_window_model(tiny_model_dir, tmp_path_factory)
    cfg = config(
        model={"path": model_dir},
        prefill={"engine": {"num_kv_blocks": 96, "max_num_seqs": 4}},
        decode={"engine": {"num_kv_blocks": 96, "max_num_seqs": 4}},
    )
    prefill = PrefillServer(cfg, model_dir)
    plain_prefill = PrefillServer(cfg, model_dir, engine_factory=no_window_pool)
    client = InProcessPrefill(prefill)
    decode = DecodeServer(cfg, model_dir, prefill=client)
    plain_decode = DecodeServer(
        cfg, model_dir, prefill=InProcessPrefill(prefill), engine_factory=no_window_pool
    )
    reference = LLMEngine.from_pretrained(model_dir, num_kv_blocks=96, device="cpu")
    yield Replicas(prefill, plain_prefill, decode, plain_decode, client, reference)
    for server in (decode, plain_decode, prefill, plain_prefill):
        server.shutdown()


def expected(r: Replicas, prompt: list[int]) -> list[int]:
    return greedy_tokens(r.reference, prompt, MAX_TOKENS)


def test_a_window_model_hands_off_only_the_window_and_matches(replicas: Replicas) -> None:
    r = replicas
    assert r.decode.engine.window_kv_cache is not None
    assert r.prefill.engine.window_kv_cache is not None
    assert r.plain_decode.engine.window_kv_cache is None
    full_pool, window_pool = r.decode.engine.kv_cache, r.decode.engine.window_kv_cache
    block = r.decode.block_size
    # Bytes of one block of one layer (K and V), the same in both pools.
    block_bytes = full_pool[0, :, 0].numel() * full_pool.element_size()
    prompts = {"w300": long_prompt(61, 300), "w70": long_prompt(62, 70)}
    before = r.decode.counters()

    async def run() -> list[list[Any]]:
        return await asyncio.gather(
            *(collect(r.decode, request(rid, p, MAX_TOKENS)) for rid, p in prompts.items())
        )

    results = dict(zip(prompts, asyncio.run(run()), strict=True))
    want_bytes = 0
    for rid, prompt in prompts.items():
        assert results[rid][0].prefill_location == "remote", rid
        assert tokens(results[rid]) == expected(r, prompt), rid
        n = len(prompt)
        blocks = -(-n // block)
        first_in_window = (n - WINDOW + 1) // block
        want_bytes += blocks * full_pool.shape[0] * block_bytes
        want_bytes += (blocks - first_in_window) * window_pool.shape[0] * block_bytes
    after = r.decode.counters()
    assert after.kv_bytes_received - before.kv_bytes_received == want_bytes
    every_block = sum(-(-len(p) // block) for p in prompts.values()) * block_bytes * 2
    assert want_bytes < every_block  # 300 tokens: 19 blocks on the full layer, 3 windowed
    for server in (r.decode, r.prefill):
        report = integrity(server)
        assert report.num_window_total_blocks > 0, report
        assert report.idle, report
    # What the prefill router prices a hand-off by: every layer per token, of which the
    # window layers' share moves only for the first decoded token's window.
    stats = r.prefill.record_routing_stats()
    token_bytes = block_bytes // block
    assert stats["window_kv_bytes_per_token"] == window_pool.shape[0] * token_bytes
    assert stats["kv_bytes_per_token"] == (full_pool.shape[0] + window_pool.shape[0]) * token_bytes
    assert stats["kv_window"] == WINDOW


class Tally:
    """Stands in for a metrics counter: the sum of what was counted."""

    def __init__(self) -> None:
        self.total = 0

    def inc(self, value: float = 1) -> None:
        self.total += int(value)


def test_a_follow_up_turn_takes_the_decode_sides_prefix_and_matches(
    r: Replicas, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Turn 2 extends turn 1 and its answer: the decode replica's prefix cache holds turn 1's
    full-layer blocks but only the window-layer blocks of its last window and of the tokens
    it decoded, so its hit is shortened to what both pools hold; the rest comes from the
    prefill replica and the tokens still equal one engine's. The skipped-KV metrics count
    what did not move: the hit's blocks on every layer, and the window layers' blocks
    before the first decoded token's window."""
    skipped_blocks, skipped_bytes = Tally(), Tally()
    monkeypatch.setattr(r.decode.metrics, "kv_transfer_skipped_blocks", skipped_blocks)
    monkeypatch.setattr(r.decode.metrics, "kv_transfer_skipped_bytes", skipped_bytes)
    pool, window_pool = r.decode.engine.kv_cache, r.decode.engine.window_kv_cache
    assert window_pool is not None
    block_bytes = pool[0, :, 0].numel() * pool.element_size()
    turn1 = long_prompt(67, 100)
    first = asyncio.run(collect(r.decode, request("t1", turn1, MAX_TOKENS)))
    assert first[0].prefill_location == "remote"
    # No hit; the window layer skips blocks 0..3 ((100 - 31) // 16 = 4).
    turn1_skipped = 4 * window_pool.shape[0] * block_bytes
    assert (skipped_blocks.total, skipped_bytes.total) == (0, turn1_skipped)
    turn2 = turn1 + tokens(first) + long_prompt(68, 60)  # 172 tokens: 11 blocks
    before = r.decode.counters().kv_bytes_received
    second = asyncio.run(collect(r.decode, request("t2", turn2, MAX_TOKENS)))
    assert second[0].prefill_location == "remote"
    assert tokens(second) == expected(r, turn2)
    # The decode side's hit: 6 blocks (turn 1's 111 computed tokens), whose window (tokens
    # 65..95, blocks 4 and 5) it holds. The full layer gets blocks 6..10, the window layer
    # blocks 8..10 (the first decoded token's window: (172 - 31) // 16 = 8).
    moved = r.decode.counters().kv_bytes_received - before
    assert moved == (5 + 3) * block_bytes
    # Turn 2 skips the hit's 6 blocks on the full layer and 8 on the window layer.
    turn2_skipped = (6 * pool.shape[0] + 8 * window_pool.shape[0]) * block_bytes
    assert skipped_blocks.total == 6
    assert skipped_bytes.total == turn1_skipped + turn2_skipped
    assert integrity(r.decode).idle and integrity(r.prefill).idle


def test_a_failed_remote_prefill_is_recomputed_with_the_window_pool(r: Replicas) -> None:
    check_failed_prefill_is_recomputed(
        r.decode, r.client, r.reference, "w-fail", long_prompt(63, 150), MAX_TOKENS
    )


@pytest.mark.parametrize("side", ["decode keeps none", "prefill keeps none"])
def test_a_peer_without_the_window_pool_is_refused_and_the_prompt_recomputed(
    r: Replicas, side: str
) -> None:
    decode = r.plain_decode if side == "decode keeps none" else r.decode
    if side == "prefill keeps none":
        r.client.server = r.plain_prefill
    try:
        prompt = long_prompt(64 if side == "decode keeps none" else 65, 120)
        chunks = asyncio.run(collect(decode, request(f"w-{side}", prompt, MAX_TOKENS)))
    finally:
        r.client.server = r.prefill
    assert chunks[0].prefill_location == "fallback"
    assert all(c.error is None for c in chunks)
    assert tokens(chunks) == expected(r, prompt)
    for server in (decode, r.prefill, r.plain_prefill):
        assert integrity(server).idle


def test_the_prefill_replica_names_the_mismatch(r: Replicas) -> None:
    sampling = SamplingOptions(max_tokens=1, temperature=0.0)
    target = make_kv_target("m", 2)
    plain = PrefillRequest(
        request_id="m", prompt_token_ids=long_prompt(66, 20), sampling=sampling,
        kv_targets=(target,),
    )  # fmt: skip
    with pytest.raises(WindowPairingError, match="sent no window-pool target"):
        asyncio.run(r.prefill.prefill(plain))
    windowed = plain.model_copy(update={"window_kv_targets": (target,)})
    with pytest.raises(WindowPairingError, match="keeps every layer's KV in one pool"):
        asyncio.run(r.plain_prefill.prefill(windowed))
    assert integrity(r.prefill).idle and integrity(r.plain_prefill).idle


@pytest.fixture()
def r(replicas: Replicas) -> Replicas:
    replicas.client.reset()
    return replicas
