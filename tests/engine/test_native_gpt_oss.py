"""The native gpt-oss class against transformers itself (float32).

A tiny random gpt-oss built by transformers (attention with q/k/v/o biases and learned sinks,
a sliding layer with a 32-token window next to a full one, YaRN RoPE, biased router and
experts with the clamped SwiGLU, its limit lowered so the clamps bite) is loaded from its
checkpoint into pdserve's own class (``model_impl`` auto must pick it): greedy tokens must
equal ``transformers.generate`` and logprobs be within 1e-4 of transformers' log-softmax for
prompts of 1 to 600 tokens (far past the window) joining at different steps, under the
default budget and under a 32-token chunked-prefill budget with a pool small enough to
force preemption and recompute, and with heads and experts split over two tensor-parallel
ranks. A bfloat16 engine agrees on the first tokens. ``layer_types`` the class cannot
attend are refused. (MXFP4 checkpoints: ``test_native_mxfp4.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model_config
from tests.engine.tiny_hf_models import build_tiny_model
from tests.engine.transformers_reference import (
    ARRIVALS,
    PREEMPT_ARRIVALS,
    Reference,
    assert_bf16_first_tokens_agree,
    assert_experts_packed,
    check_native_engine,
)

NUM_NEW = 16
# A limit the tiny model's gate/up outputs cross (the real model's is 7.0).
OVERRIDES = {"swiglu_limit": 1.5}


@pytest.fixture(scope="module")
def gpt_oss(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Reference]:
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(
        "gpt-oss", tmp_path_factory.mktemp("gpt-oss"), tiny_model_dir, **OVERRIDES
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, Reference(hf, hf.config.vocab_size)


def test_config_reads_windows_sinks_yarn_and_experts(gpt_oss) -> None:
    cfg = load_model_config(gpt_oss[0])
    assert cfg.impl == "native" and cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias
    assert [layer.sliding_window for layer in cfg.kv_layers] == [32, None]
    assert cfg.sliding_window is None  # the full layers attend the whole context
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.moe is not None and cfg.moe.softmax_after_topk and cfg.moe.biases
    assert cfg.moe.activation is not None and cfg.moe.activation.limit == 1.5


def test_default_schedule_matches_transformers(gpt_oss) -> None:
    model_dir, ref = gpt_oss
    check_native_engine(LLMEngine(EngineConfig(model=str(model_dir))), ref, ARRIVALS, NUM_NEW)


def test_chunked_prefill_and_preemption_match_transformers(gpt_oss) -> None:
    model_dir, ref = gpt_oss
    config = EngineConfig(
        model=str(model_dir), num_kv_blocks=40, max_model_len=640, max_num_batched_tokens=32
    )
    engine = LLMEngine(config)
    check_native_engine(engine, ref, PREEMPT_ARRIVALS, NUM_NEW)
    assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"


def test_heads_and_experts_split_over_two_ranks_match_transformers(gpt_oss) -> None:
    """Tensor parallelism (gloo between real processes): each rank holds half the heads
    (and their sinks) and half of each expert's columns, and its heads of both KV pools
    (the window layers' in a pool of their own); the tokens stay transformers'."""
    model_dir, ref = gpt_oss
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=2))
    try:
        assert engine.window_layout is not None
        window_pool = engine.window_kv_cache
        assert window_pool is not None
        # rank 0's pools: half of the model's KV heads each
        assert window_pool.shape[-2] == engine.kv_cache.shape[-2]
        assert window_pool.shape[-2] * 2 == engine.model_config.num_kv_heads
        check_native_engine(engine, ref, ARRIVALS[:5], NUM_NEW)
    finally:
        engine.shutdown()


def test_bfloat16_engine_runs_and_agrees_with_float32(gpt_oss) -> None:
    """bf16 weights (experts prepacked), sinks and expert biases; the router stays
    float32. Sharp tiny logits: the first greedy token agrees with float32 transformers."""
    assert_experts_packed(assert_bf16_first_tokens_agree(str(gpt_oss[0]), gpt_oss[1]))


@pytest.mark.parametrize(
    ("layer_types", "message"),
    [
        (["sliding_attention"], "1 entries for 2 layers"),
        (["sliding_attention", "chunked_attention"], "unsupported"),
    ],
)
def test_layer_types_it_cannot_attend_are_refused(
    gpt_oss, tmp_path: Path, layer_types: list[str], message: str
) -> None:
    config = json.loads((gpt_oss[0] / "config.json").read_text())
    config["layer_types"] = layer_types
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model_config(tmp_path)
