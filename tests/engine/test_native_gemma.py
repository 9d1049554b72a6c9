"""The native Gemma 2 and Gemma 3 (text) classes against transformers itself (float32).

Tiny random models built by transformers, with sliding windows (48 / 40 tokens) smaller
than the longest prompts: Gemma 2 with attention and final logit softcaps, Gemma 3 with
q/k norms, its own RoPE base on the sliding layers and linearly scaled RoPE on the full
ones, and a tied output embedding. ``model_impl`` auto must pick the native class; greedy
tokens must equal ``transformers.generate`` and logprobs be within 1e-4 of transformers'
log-softmax, for prompts of 1 to 600 tokens joining at different steps, under the default
budget, under a 32-token chunked-prefill budget with a pool small enough to force
preemption and recompute, and split over two tensor-parallel ranks (gloo). Gemma 3's
config in its released spelling gives transformers' layer layout; what the native class
cannot run is refused at load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model_config
from tests.engine.transformers_reference import (
    ARRIVALS,
    GEMMA3_TINY,
    PREEMPT_ARRIVALS,
    assert_bf16_first_tokens_agree,
    check_schedule,
    small_pool_config,
    tiny_models_fixture,
)

NUM_NEW = 16
# name -> (tiny spec, config overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {"gemma2": ("gemma2", {}), "gemma3": GEMMA3_TINY}
hf_model = tiny_models_fixture(MODELS, "models")


def test_default_schedule_matches_transformers(hf_model) -> None:
    from pdserve.engine.models.gemma import GemmaForCausalLM

    model_dir, ref = hf_model
    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    assert isinstance(engine.runner.model, GemmaForCausalLM)
    check_schedule(engine, ref, ARRIVALS, NUM_NEW, "native")


def test_chunked_prefill_and_preemption_match_transformers(hf_model) -> None:
    model_dir, ref = hf_model
    engine = LLMEngine(small_pool_config(model_dir))
    check_schedule(engine, ref, PREEMPT_ARRIVALS, NUM_NEW, "native")
    assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"


def test_heads_split_over_two_ranks_match_transformers(hf_model) -> None:
    """Tensor parallelism (gloo between real processes): each rank holds half the heads and
    MLP columns; the norms, softcaps and windows are replicated; the tokens stay
    transformers'."""
    model_dir, ref = hf_model
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=2))
    try:
        check_schedule(engine, ref, ARRIVALS[:5], NUM_NEW, "native")
    finally:
        engine.shutdown()


def _write_config(model_dir: Path, **fields: Any) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    base = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 2048,
        "torch_dtype": "bfloat16",
    }
    (model_dir / "config.json").write_text(json.dumps({**base, **fields}))
    return model_dir


def test_gemma3_config_in_its_released_spelling(tmp_path: Path) -> None:
    """The keys Gemma 3 checkpoints were released with (a local RoPE base, a sliding-window
    pattern, global RoPE scaling) give the layout transformers runs: five sliding layers
    then a full one, the local base on the sliding layers, the scaled global RoPE on the
    full ones, queries scaled by query_pre_attn_scalar, tied embeddings."""
    model_dir = _write_config(
        tmp_path / "gemma3",
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=512,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
        max_position_embeddings=32768,
    )
    cfg = load_model_config(model_dir)
    assert cfg.impl == "native" and cfg.gemma is not None
    windows = [spec.sliding_window for spec in cfg.kv_layers]
    assert windows == [512] * 5 + [None] + [512] * 5 + [None]
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (cfg.gemma.sliding_rope_theta, cfg.gemma.sliding_rope_scaling) == (1e4, None)
    assert cfg.gemma.sliding_layers == tuple(window is not None for window in windows)
    assert cfg.gemma.query_scale == 256**-0.5 and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.max_context == 32768  # windows limit what a layer attends, not the context
    assert load_model_config(model_dir, "transformers").impl == "transformers"


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
    ],
)
def test_what_the_native_class_cannot_run_is_refused(
    tmp_path: Path, fields: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        load_model_config(_write_config(tmp_path / "gemma3", **fields))


def test_bfloat16_engine_agrees_with_float32(hf_model) -> None:
    """bf16 weights (the norms' ``1 + weight`` still summed in float32, the embedding
    scale rounded to bf16 as transformers does): the first greedy token agrees with
    transformers' float32 on all but at most one prompt."""
    model_dir, ref = hf_model
    assert_bf16_first_tokens_agree(str(model_dir), ref)
