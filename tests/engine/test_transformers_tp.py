"""Tensor parallelism on the transformers-backed path (CPU, gloo between real processes),
split by each model's own ``base_model_tp_plan``.

At TP=2 tiny random Qwen3, Gemma 3 (sliding and full layers, scaled embedding), GLM-4
(gathered MLP output, split-input down projection), Gemma 2 (softcaps), Granite
(multipliers, logits scaling), Qwen3-MoE and Mixtral (per-expert checkpoint tensors fused at
load, experts replicated as their plans leave them) give transformers' float32 greedy tokens
and logprobs, each rank's paged KV cache holding its own KV head, under a chunked-prefill
budget with a pool small enough to force preemption (and, for Qwen3, the default budget).
Models the plan cannot split are refused from their config alone, before any rank starts or
any weight is read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.engine.tiny_hf_models import build_tiny_model, tiny_config
from tests.engine.transformers_reference import (
    ARRIVALS,
    PREEMPT_ARRIVALS,
    Reference,
    assert_clean,
    assert_matches,
    make_prompt,
    run,
)

NUM_NEW = 16
SMALL_POOL = {"num_kv_blocks": 48, "max_model_len": 640, "max_num_batched_tokens": 128}
# (model, schedule): the small pool forces chunked prefill and preemption; "tied-odd-vocab"
# also ties the lm_head to the embedding (as Gemma checkpoints do) over a vocabulary that
# does not divide by 2 (the last rank's rows end in padding).
CASES = [
    ("qwen3", "small-pool"),
    ("qwen3", "default"),
    ("gemma3", "small-pool"),
    ("glm4", "small-pool"),
    ("gemma2", "small-pool"),
    ("granite", "small-pool"),
    ("qwen3-moe", "small-pool"),
    ("mixtral", "small-pool"),
    ("gemma3", "tied-odd-vocab"),
]


@pytest.mark.parametrize(("name", "schedule"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_tp2_greedy_and_logprobs_match_transformers(
    name: str, schedule: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    tied = {"tie_word_embeddings": True, "vocab_size": 2047}
    overrides = tied if schedule == "tied-odd-vocab" else {}
    model_dir = build_tiny_model(name, tmp_path, tiny_model_dir, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = Reference(hf, hf.config.vocab_size)
    small = schedule != "default"
    pool = SMALL_POOL if small else {}
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            tensor_parallel_size=2,
            model_impl="transformers",
            **pool,
        )  # fmt: skip
    )
    try:
        assert engine.runner.model_config.impl == "transformers"
        assert engine.kv_cache.shape[-2] == 1  # 2 KV heads: one per rank
        timeline = PREEMPT_ARRIVALS if small else ARRIVALS
        arrivals = [
            (at, f"r{i}", make_prompt(n, seed=i, vocab=ref.vocab_size))
            for i, (at, n) in enumerate(timeline)
        ]
        final = run(engine, arrivals, num_new=NUM_NEW)
        for _, rid, prompt in arrivals:
            assert_matches(ref, prompt, final[rid], NUM_NEW)
        if small:
            assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
        assert_clean(engine)
    finally:
        engine.shutdown()


def _config_only(out: Path, name: str, architecture: str) -> Path:
    """A tiny model's config.json without weights: a refusal must come from it alone."""
    config = tiny_config(name)
    config.architectures = [architecture]
    config.save_pretrained(out)
    return out


# (tiny model, architecture, tensor_parallel_size, the reason given)
REFUSALS = [
    ("gpt-oss", "GptOssForCausalLM", 2, "does not split attention by heads"),
    ("phi3", "Phi3ForCausalLM", 2, "does not split attention by heads"),
    ("deepseek-v3", "DeepseekV3ForCausalLM", 2, "mla_kv_a_proj, which pdserve does not apply"),
    ("qwen3", "Qwen3ForCausalLM", 4, r"num_key_value_heads \(2\) is not divisible by .* \(4\)"),
]


def test_what_the_plan_cannot_split_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    import transformers as tf

    opt = tmp_path / "opt"
    tf.OPTConfig(architectures=["OPTForCausalLM"], num_hidden_layers=2).save_pretrained(opt)
    cases = [(opt, "OPTForCausalLM", 2, "has no tensor-parallel plan")]
    for name, arch, tp, reason in REFUSALS:
        cases.append((_config_only(tmp_path / name, name, arch), arch, tp, reason))
    for model_dir, arch, tp, reason in cases:
        with pytest.raises(ValueError, match=reason) as info:
            LLMEngine(
                EngineConfig(
                    model=str(model_dir),
                    device="cpu",
                    tensor_parallel_size=tp,
                    model_impl="transformers",
                )  # fmt: skip
            )
        assert arch in str(info.value)
        assert "\n" not in str(info.value)  # one line
