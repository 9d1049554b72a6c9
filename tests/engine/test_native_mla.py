"""The native DeepSeek-V3 class (multi-head latent attention over a latent KV cache)
against transformers itself (float32).

Tiny random DeepSeek-V3 models built by transformers (q LoRA with interleaved rope and a
dense first layer; and plain q, neox rope, yarn with DeepSeek's mscale, grouped routing
over two shared experts) and two DeepSeek-V2s (softmax routing, greedy or group-limited
(groups scored by their best expert), scaled, not renormalised; complex-number rope) load
into pdserve's own class (``model_impl`` auto must pick it):
greedy tokens must equal ``transformers.generate`` and logprobs be within 1e-4 of
transformers' log-softmax, for prompts of 1 to 600 tokens joining at different steps,
under the default budget and under a 32-token chunked-prefill budget with a pool small
enough to force preemption. The pool holds one latent head per token in one plane (tensor
parallelism: ``test_mla_tp.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.engine.tiny_hf_models import build_tiny_model
from tests.engine.transformers_reference import (
    ARRIVALS,
    PREEMPT_ARRIVALS,
    Reference,
    assert_experts_packed,
    check_native_engine,
    make_prompt,
    run,
    small_pool_config,
    tiny_model_and_reference,
)

NUM_NEW = 16
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
# name -> (tiny spec, config overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "v3-qlora-interleaved": ("deepseek-v3", {}),
    "v3-yarn-neox-grouped": (
        "deepseek-v3",
        {
            "q_lora_rank": None,
            "rope_interleave": False,
            "rope_parameters": YARN,
            "n_group": 2,
            "topk_group": 1,
            "n_shared_experts": 2,
            "first_k_dense_replace": 0,
        },
    ),
    "v2-softmax-greedy": ("deepseek-v2", {}),
    # top_k above topk_group (as in DeepSeek-V2's 6 of 3 groups): otherwise the kept groups
    # always hold the plain greedy choice.
    "v2-group-limited": (
        "deepseek-v2",
        {
            "topk_method": "group_limited_greedy",
            "n_routed_experts": 12,
            "num_experts_per_tok": 3,
            "n_group": 4,
            "topk_group": 2,
        },
    ),
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
    cfg = engine.runner.model_config
    assert cfg.impl == "native" and cfg.mla is not None
    # One cached head per token, the 16-wide latent and the 8-wide rope key, in one plane
    # (read as keys and as values).
    assert engine.kv_cache.shape[1] == 1
    assert tuple(engine.kv_cache.shape[-2:]) == (1, 16 + 8)
    check_native_engine(engine, ref, schedule, NUM_NEW)


def test_default_schedule_matches_transformers(hf_model) -> None:
    model_dir, ref = hf_model
    _check(LLMEngine(EngineConfig(model=str(model_dir))), ref, ARRIVALS)


def test_chunked_prefill_and_preemption_match_transformers(hf_model) -> None:
    model_dir, ref = hf_model
    engine = LLMEngine(small_pool_config(model_dir))
    _check(engine, ref, PREEMPT_ARRIVALS)
    assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"), [("bfloat16", "auto"), ("float32", "int8")], ids=str
)
def test_low_precision_engine_runs_and_agrees_with_transformers(
    dtype: str, kv_cache_dtype: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """bf16 on CPU (packed linears, bf16 latent cache, bf16 experts), and an int8 latent
    cache with calibrated scales: the sharp tiny logits give transformers' (float32) first
    greedy token."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model("deepseek-v3", tmp_path, tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = Reference(hf, hf.config.vocab_size)
    config = EngineConfig(model=str(model_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(config)
    want = torch.int8 if kv_cache_dtype == "int8" else torch.bfloat16
    assert engine.kv_cache.dtype == want
    if engine.kv_scales is not None:  # the one plane is read as K and V: one scale for both
        assert torch.equal(engine.kv_scales[:, 0], engine.kv_scales[:, 1])
    prompts = [make_prompt(n, seed=i, vocab=ref.vocab_size) for i, (_, n) in enumerate(ARRIVALS)]
    final = run(engine, [(0, f"r{i}", p) for i, p in enumerate(prompts)], num_new=4)
    agree = sum(final[f"r{i}"].token_ids[0] == ref.generate(p)[0] for i, p in enumerate(prompts))
    assert agree >= len(prompts) - 1, f"only {agree} of {len(prompts)} first tokens agree"
    if dtype == "bfloat16":  # routed and shared experts prepacked for oneDNN
        assert_experts_packed(engine)


def test_v2_unknown_routing_method_is_refused_natively(tmp_path: Path) -> None:
    from pdserve.engine.loader import load_model_config
    from tests.engine.tiny_hf_models import tiny_config

    config = tiny_config("deepseek-v2", topk_method="noaux_tc", n_group=2)
    config.architectures = ["DeepseekV2ForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="topk_method 'noaux_tc'.*group_limited_greedy"):
        load_model_config(tmp_path, "native")
    assert load_model_config(tmp_path, "transformers").impl == "transformers"
