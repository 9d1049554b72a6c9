"""The native Qwen3, Qwen3-MoE and Mixtral classes against transformers itself (float32).

Tiny random models built by transformers (Qwen3-MoE also with a dense first layer and
renormalised top-k, the two config switches of that family) are loaded from their
checkpoints into pdserve's own classes (``model_impl`` auto must pick native): greedy
tokens must equal ``transformers.generate`` and logprobs be within 1e-4 of transformers'
log-softmax, for prompts of 1 to 600 tokens joining at different steps, under the default
budget, and under a 32-token chunked-prefill budget with a pool small enough to force
preemption and recompute, and with the experts split over two tensor-parallel ranks. A
checkpoint missing an expert is refused at load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels.ops import QuantizedExperts
from tests.engine.tiny_hf_models import build_tiny_model
from tests.engine.transformers_reference import (
    ARRIVALS,
    PREEMPT_ARRIVALS,
    Reference,
    assert_bf16_first_tokens_agree,
    assert_experts_packed,
    assert_first_tokens_agree,
    check_native_engine,
    small_pool_config,
    tiny_model_and_reference,
)

NUM_NEW = 16
# name -> (tiny spec, config overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {}),
    "qwen3-moe": ("qwen3-moe", {}),
    "qwen3-moe-dense0-norm": ("qwen3-moe", {"mlp_only_layers": [0], "norm_topk_prob": True}),
    "mixtral": ("mixtral", {}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def hf_model(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Reference]:
    spec, extra = MODELS[request.param]
    return tiny_model_and_reference(
        request.param, spec, extra, tiny_model_dir, tmp_path_factory.mktemp("models")
    )


def _check(engine: LLMEngine, ref: Reference, schedule: list[tuple[int, int]]) -> None:
    check_native_engine(engine, ref, schedule, NUM_NEW)


def test_default_schedule_matches_transformers(hf_model) -> None:
    model_dir, ref = hf_model
    _check(LLMEngine(EngineConfig(model=str(model_dir))), ref, ARRIVALS)


def test_chunked_prefill_and_preemption_match_transformers(hf_model) -> None:
    model_dir, ref = hf_model
    engine = LLMEngine(small_pool_config(model_dir))
    _check(engine, ref, PREEMPT_ARRIVALS)
    assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"


def test_checkpoint_missing_an_expert_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = build_tiny_model("mixtral", tmp_path, tiny_model_dir)
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights for: model\.layers\.1\.mlp\.w13"):
        LLMEngine(EngineConfig(model=str(model_dir)))


@pytest.mark.parametrize("name", ["qwen3-moe-dense0-norm", "mixtral"])
def test_experts_split_over_two_ranks_match_transformers(
    name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Tensor parallelism (gloo between real processes): every rank holds its half of each
    expert's intermediate columns; the tokens stay transformers'."""
    from transformers import AutoModelForCausalLM

    spec, extra = MODELS[name]
    model_dir = build_tiny_model(spec, tmp_path, tiny_model_dir, **extra)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=2))
    try:
        _check(engine, Reference(hf, hf.config.vocab_size), ARRIVALS[:5])
    finally:
        engine.shutdown()


def test_bfloat16_engine_runs_and_agrees_with_float32(tiny_model_dir: Path, tmp_path: Path) -> None:
    """bf16 on CPU packs the dense linears and the experts (oneDNN); the router stays a
    float32 matmul. Sharp tiny logits: the first greedy token agrees."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model("qwen3-moe", tmp_path, tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = assert_bf16_first_tokens_agree(str(model_dir), Reference(hf, hf.config.vocab_size))
    assert_experts_packed(engine)


@pytest.mark.parametrize("method", ["int8", "int8-weight-only"])
def test_at_load_int8_quantizes_the_experts_too(
    method: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """At-load int8 on CPU runs every expert on the int8 kernels (the dense linears were
    already); the first greedy tokens still agree with float32 transformers."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model("qwen3-moe", tmp_path, tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(model_dir), quantization=method))
    try:
        blocks = [m for m in engine.runner.model.modules() if hasattr(m, "packed_experts")]
        assert blocks and all(isinstance(b.packed_experts, QuantizedExperts) for b in blocks)
        assert all(b.w13.is_meta and b.w2.is_meta for b in blocks)  # the float copy freed
        assert_first_tokens_agree(engine, Reference(hf, hf.config.vocab_size))
    finally:
        engine.shutdown()
