"""The native DeepSeek class under tensor parallelism (CPU, gloo between real processes).

At TP=2 the query heads, ``kv_b_proj``'s per-head up-projections and ``o_proj`` are split,
the latent projection is replicated and every rank caches the same one-head latent; the
dense MLP and every expert (routed and shared) are split by intermediate columns. Tiny
random DeepSeek-V3 / V2 models built by transformers give transformers' float32 greedy
tokens and logprobs under the default budget and under a 32-token chunked-prefill budget
with a pool small enough to force preemption; an int8 latent cache gives the tokens of the
same cache on one rank. Heads that do not divide by the ranks are refused before any
worker starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.engine.tiny_hf_models import build_tiny_model
from tests.engine.transformers_reference import (
    ARRIVALS,
    PREEMPT_ARRIVALS,
    check_native_engine,
    load_reference,
    make_prompt,
    run,
)

NUM_NEW = 16
# As ``small_pool_config``: a 32-token budget and a pool that forces preemption.
SMALL_POOL = {"num_kv_blocks": 40, "max_model_len": 640, "max_num_batched_tokens": 32}
# (tiny spec, config overrides, schedule): V3 with q LoRA, interleaved rope and a dense first
# layer; V2 with plain q, two shared experts and biased attention (o_proj's bias added once).
CASES = [
    ("deepseek-v3", {}, "default"),
    ("deepseek-v3", {}, "small-pool"),
    ("deepseek-v2", {"attention_bias": True}, "small-pool"),
]


@pytest.mark.parametrize(
    ("spec", "overrides", "schedule"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES]
)
def test_tp2_matches_transformers(
    spec: str, overrides: dict, schedule: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = build_tiny_model(spec, tmp_path, tiny_model_dir, **overrides)
    ref = load_reference(model_dir)
    small = schedule == "small-pool"
    pool = SMALL_POOL if small else {}
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=2, **pool)
    )
    try:
        cfg = engine.runner.model_config
        assert cfg.mla is not None and engine.runner.tp.size == 2
        # Rank 0 holds half the query heads and the whole one-head latent slot.
        layers = engine.runner.runner.model.model.layers
        assert layers[0].self_attn.num_heads == cfg.num_heads // 2
        assert cfg.moe is not None and layers[-1].mlp.w2.shape[-1] == cfg.moe.intermediate_size // 2
        assert tuple(engine.kv_cache.shape[1:2]) + tuple(engine.kv_cache.shape[-2:]) == (
            1,
            1,
            cfg.mla.latent_dim,
        )
        check_native_engine(engine, ref, PREEMPT_ARRIVALS if small else ARRIVALS, NUM_NEW)
        if small:
            assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
    finally:
        engine.shutdown()


def test_tp2_int8_latent_gives_the_tokens_of_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = build_tiny_model("deepseek-v3", tmp_path, tiny_model_dir)
    arrivals = [
        (at, f"r{i}", make_prompt(n, seed=i, vocab=2048)) for i, (at, n) in enumerate(ARRIVALS)
    ]
    tokens = {}
    for tp in (1, 2):
        config = EngineConfig(
            model=str(model_dir), device="cpu", kv_cache_dtype="int8", tensor_parallel_size=tp
        )
        engine = LLMEngine(config)
        try:
            assert engine.kv_cache.dtype == torch.int8
            final = run(engine, arrivals, num_new=NUM_NEW)
            tokens[tp] = {rid: out.token_ids for rid, out in final.items()}
        finally:
            engine.shutdown()
    assert tokens[2] == tokens[1]


def test_heads_that_do_not_split_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = build_tiny_model("deepseek-v3", tmp_path, tiny_model_dir)  # 4 heads
    config = EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=3)
    with pytest.raises(
        ValueError,
        match=r"DeepseekV3ForCausalLM: num_attention_heads \(4\) is not divisible by "
        r"tensor_parallel_size \(3\)",
    ):
        LLMEngine(config)


def test_transformers_path_refusal_points_to_the_native_class(tmp_path: Path) -> None:
    """The transformers path cannot apply DeepSeek's plan (``mla_kv_a_proj``); its refusal
    names the native class, which runs it, from config.json alone."""
    from tests.engine.tiny_hf_models import tiny_config

    config = tiny_config("deepseek-v3")
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(tmp_path)
    engine_config = EngineConfig(
        model=str(tmp_path), device="cpu", tensor_parallel_size=2, model_impl="transformers"
    )
    with pytest.raises(ValueError, match=r"mla_kv_a_proj.*use model_impl 'native'"):
        LLMEngine(engine_config)
