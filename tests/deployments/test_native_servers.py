"""Every native model class across the served P/D split, no Ray: the real prefill and decode
servers of one tiny random model built by transformers (float32) in one process, the real
shared-memory KV hand-off. Prompts longer than the local-prefill limit (and than any
window) are prefilled on the prefill replica while a short one is prefilled locally, all at
once; every stream's greedy tokens equal ``transformers.generate``, the decode replica
received exactly the prompts' blocks of KV as the model's config sizes them (window layers:
only the first decoded token's window; MLA: one latent plane), and both replicas end idle.
A follow-up turn moves only the blocks the decode side's prefix cache lacks, and a failed
remote prefill is recomputed on the decode side, both with transformers' tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdserve.deployments.decode_server import DecodeServer
from pdserve.deployments.messages import GenerateChunk
from pdserve.deployments.prefill_server import PrefillServer
from pdserve.kvtransfer.blocks import pool_layout
from tests.deployments.in_process import SHORT, collect, config, long_prompt, request, tokens
from tests.deployments.serving_fakes import InProcessPrefill
from tests.engine.tiny_hf_models import build_tiny_model
from tests.engine.transformers_reference import load_reference

MAX_TOKENS = 16
LOCAL_PREFILL_MAX = 32
# Longer than the local-prefill limit and than every window below (at most 48 tokens);
# 90 tokens fill 6 blocks of 16, 61 end inside a block.
PROMPTS = {"long-90": long_prompt(71, 90), "long-61": long_prompt(72, 61), "short": SHORT}
WHERE = {"long-90": "remote", "long-61": "remote", "short": "local"}
# A conversation: turn 2 extends turn 1's prompt and answer by 40 tokens.
TURN_1, TURN_2 = "turn-1", "turn-2"
TURN_1_PROMPT = long_prompt(73, 70)
FAILED = "failed-remote"
FAILED_PROMPT = long_prompt(75, 80)


def turn_2_prompt(answer: list[int]) -> list[int]:
    return TURN_1_PROMPT + answer + long_prompt(74, 40)


# One tiny config per native class (tests/engine/tiny_hf_models.py), with the overrides
# that make its own features bite.
NATIVE: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {},
    "qwen3-moe": {},
    "mixtral": {},
    "gemma2": {},
    "gemma3": {},
    "gpt-oss": {"swiglu_limit": 1.5},
    "deepseek-v2": {},
    "deepseek-v3": {},
}


@dataclass
class Served:
    name: str
    hf_config: Any
    prefill: PrefillServer
    decode: DecodeServer
    client: InProcessPrefill  # the decode replica's way to the prefill replica
    expected: dict[str, list[int]]  # transformers' greedy tokens per prompt


@pytest.fixture(scope="module", params=list(NATIVE))
def served(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    name = request.param
    model_dir = build_tiny_model(
        name, tmp_path_factory.mktemp(name), tiny_model_dir, **NATIVE[name]
    )
    ref = load_reference(model_dir)
    expected = {rid: ref.generate(p, MAX_TOKENS) for rid, p in PROMPTS.items()}
    expected[TURN_1] = ref.generate(TURN_1_PROMPT, MAX_TOKENS)
    expected[TURN_2] = ref.generate(turn_2_prompt(expected[TURN_1]), MAX_TOKENS)
    expected[FAILED] = ref.generate(FAILED_PROMPT, MAX_TOKENS)
    hf_config = ref.model.config
    del ref
    cfg = config(
        model={"path": str(model_dir)},
        policy={"local_prefill_max_tokens": LOCAL_PREFILL_MAX},
    )
    prefill = PrefillServer(cfg, str(model_dir))
    client = InProcessPrefill(prefill)
    decode = DecodeServer(cfg, str(model_dir), prefill=client)
    yield Served(name, hf_config, prefill, decode, client, expected)
    decode.shutdown()
    prefill.shutdown()


def handoff_bytes(hf: Any, block_size: int, prompt_len: int, hit_blocks: int = 0) -> int:
    """The KV bytes one remote prefill of ``prompt_len`` tokens moves, from the model's
    config alone (float32): the prompt blocks past the decode side's prefix hit of
    ``hit_blocks`` blocks, of the full-attention layers and, of the window layers, from
    the first decoded token's window on."""
    if getattr(hf, "kv_lora_rank", None):  # MLA: the latent and the rope key, one plane
        token_bytes = (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4
    else:
        token_bytes = 2 * hf.num_key_value_heads * hf.head_dim * 4
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    blocks = -(-prompt_len // block_size)
    window_blocks = 0
    if "sliding_attention" in types:
        first_in_window = (prompt_len - hf.sliding_window + 1) // block_size
        window_blocks = blocks - max(hit_blocks, first_in_window)
    block_bytes = block_size * token_bytes
    full_layers = types.count("full_attention")
    window_layers = types.count("sliding_attention")
    return ((blocks - hit_blocks) * full_layers + window_blocks * window_layers) * block_bytes


def assert_idle(s: Served) -> None:
    for server in (s.decode, s.prefill):
        report = asyncio.run(server.check_integrity())
        assert report.idle, (s.name, report)


def test_remote_and_local_prefills_give_transformers_tokens(served: Served) -> None:
    s = served
    engine = s.decode.engine
    assert engine.model_config.impl == "native", s.name
    hf = s.hf_config
    if getattr(hf, "kv_lora_rank", None):
        assert pool_layout(engine.kv_cache, s.name).num_planes == 1
    windowed = "sliding_attention" in (getattr(hf, "layer_types", None) or [])
    assert (engine.window_kv_cache is not None) is windowed, s.name
    before = s.decode.counters().kv_bytes_received

    async def run() -> list[list[GenerateChunk]]:
        return await asyncio.gather(
            *(collect(s.decode, request(rid, p, MAX_TOKENS)) for rid, p in PROMPTS.items())
        )

    results = dict(zip(PROMPTS, asyncio.run(run()), strict=True))
    for rid, chunks in results.items():
        assert all(c.error is None for c in chunks), (s.name, rid)
        assert tokens(chunks) == s.expected[rid], (s.name, rid)
    assert {rid: chunks[0].prefill_location for rid, chunks in results.items()} == WHERE
    moved = s.decode.counters().kv_bytes_received - before
    remote = [len(PROMPTS[rid]) for rid, where in WHERE.items() if where == "remote"]
    assert moved == sum(handoff_bytes(hf, s.decode.block_size, n) for n in remote), s.name
    assert_idle(s)


def test_a_follow_up_turn_moves_only_what_the_decode_side_lacks(served: Served) -> None:
    """The decode replica's prefix cache holds turn 1 (its prompt and its answer, but the
    last token: 85 tokens, 5 whole blocks), so turn 2's hand-off starts at block 5; the
    window layers', past the first decoded token's window too."""
    s = served
    first = asyncio.run(collect(s.decode, request(TURN_1, TURN_1_PROMPT, MAX_TOKENS)))
    assert first[0].prefill_location == "remote"
    assert tokens(first) == s.expected[TURN_1], s.name
    turn_2 = turn_2_prompt(tokens(first))
    before = s.decode.counters().kv_bytes_received
    second = asyncio.run(collect(s.decode, request(TURN_2, turn_2, MAX_TOKENS)))
    assert second[0].prefill_location == "remote"
    assert tokens(second) == s.expected[TURN_2], s.name
    hit = (len(TURN_1_PROMPT) + MAX_TOKENS - 1) // s.decode.block_size
    moved = s.decode.counters().kv_bytes_received - before
    assert moved == handoff_bytes(s.hf_config, s.decode.block_size, len(turn_2), hit), s.name
    assert_idle(s)


def test_a_failed_remote_prefill_is_recomputed_with_transformers_tokens(served: Served) -> None:
    """The prefill replica dies mid-call: the decode replica prefills the prompt into its
    own reservation (the latent pool, the window pool) and the tokens do not change."""
    s = served
    s.client.fail = RuntimeError("ActorDiedError: the prefill replica died")
    try:
        before = s.decode.counters().fallbacks
        chunks = asyncio.run(collect(s.decode, request(FAILED, FAILED_PROMPT, MAX_TOKENS)))
    finally:
        s.client.fail = None
    assert chunks[0].prefill_location == "fallback"
    assert tokens(chunks) == s.expected[FAILED], s.name
    assert s.decode.counters().fallbacks == before + 1
    assert_idle(s)
