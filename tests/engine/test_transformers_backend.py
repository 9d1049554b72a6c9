"""The transformers-backed model path against transformers itself (float32).

Tiny random models of eleven architectures, built by transformers and saved with
safetensors, run through pdserve's paged KV: greedy tokens must equal
``transformers.generate`` and logprobs must be within 1e-4 of transformers' log-softmax,
for prompts of 1 to 600 tokens joining the batch at different steps, under the default
budget and a 32-token chunked-prefill budget, with prefix-cache hits, and (on one model)
a pool small enough to force preemption and recompute. Models that cannot work are
refused at load with a reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model_config
from tests.engine.tiny_hf_models import SPECS, build_tiny_model
from tests.engine.transformers_reference import (
    ARRIVALS,
    PREEMPT_ARRIVALS,
    Reference,
    assert_clean,
    assert_matches,
    make_prompt,
    run,
    tiny_models_fixture,
)

NUM_NEW = 16


# The tiny Llama is built for the native class's served-split check; the Llama family on
# this path is checked below (test_native_llama_through_transformers_gives_native_tokens).
hf_model = tiny_models_fixture({spec: (spec, {}) for spec in SPECS if spec != "llama"}, "backend")


def _check(engine: LLMEngine, ref: Reference, arrivals: list[tuple[int, str, list[int]]]) -> None:
    final = run(engine, arrivals, num_new=NUM_NEW)
    assert sorted(final) == sorted(rid for _, rid, _ in arrivals)
    for _, rid, prompt in arrivals:
        assert_matches(ref, prompt, final[rid], NUM_NEW)


@pytest.mark.parametrize("budget", [2048, 32])
def test_greedy_and_logprobs_match_transformers(hf_model, budget: int) -> None:
    model_dir, ref = hf_model
    config = EngineConfig(
        model=str(model_dir), max_num_batched_tokens=budget, model_impl="transformers"
    )
    engine = LLMEngine(config)
    assert engine.runner.model_config.impl == "transformers"
    arrivals = [
        (at, f"r{i}", make_prompt(n, seed=i, vocab=ref.vocab_size))
        for i, (at, n) in enumerate(ARRIVALS)
    ]
    _check(engine, ref, arrivals)
    assert_clean(engine)


def test_prefix_cache_hits_match_transformers(hf_model) -> None:
    model_dir, ref = hf_model
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), max_num_batched_tokens=96, model_impl="transformers")
    )
    shared = make_prompt(200, seed=100, vocab=ref.vocab_size)
    run(engine, [(0, "first", shared + make_prompt(7, seed=101, vocab=ref.vocab_size))])
    arrivals = [
        (0, "same", list(shared)),
        (0, "longer", shared + make_prompt(40, seed=102, vocab=ref.vocab_size)),
        (1, "mid", shared[:170] + make_prompt(5, seed=103, vocab=ref.vocab_size)),
    ]
    final = run(engine, arrivals, num_new=NUM_NEW)
    for _, rid, prompt in arrivals:
        assert final[rid].num_cached_tokens >= 160, rid
        assert_matches(ref, prompt, final[rid], NUM_NEW)
    assert_clean(engine)


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss"])
def test_preemption_and_recompute_match_transformers(
    name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Sliding-window and sink layers recomputed after preemption give the same tokens."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(name, tmp_path, tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = Reference(hf, hf.config.vocab_size)
    config = EngineConfig(
        model=str(model_dir),
        num_kv_blocks=48,
        max_model_len=640,
        max_num_batched_tokens=128,
        model_impl="transformers",  # Gemma 3 has a native class too
    )
    engine = LLMEngine(config)
    assert engine.runner.model_config.impl == "transformers"
    arrivals = [
        (at, f"r{i}", make_prompt(n, seed=i, vocab=ref.vocab_size))
        for i, (at, n) in enumerate(PREEMPT_ARRIVALS)
    ]
    _check(engine, ref, arrivals)
    assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
    assert_clean(engine)


def test_native_llama_through_transformers_gives_native_tokens(
    test_model: Callable[[str], Path],
) -> None:
    model_dir = str(test_model("llama3-gqa"))
    arrivals = [
        (at, f"r{i}", make_prompt(n, seed=i, vocab=2048)) for i, (at, n) in enumerate(ARRIVALS)
    ]
    outputs = {}
    for impl in ("native", "transformers"):
        engine = LLMEngine(EngineConfig(model=model_dir, model_impl=impl))
        assert engine.runner.model_config.impl == impl
        outputs[impl] = {
            rid: o.token_ids for rid, o in run(engine, arrivals, num_new=NUM_NEW).items()
        }
        assert_clean(engine)
    assert outputs["transformers"] == outputs["native"]


def _config_only(tmp_path: Path, config) -> Path:  # type: ignore[no-untyped-def]
    """A model directory with config.json and no weights: a refusal must come from the
    config alone (nothing is read, nothing half-loaded)."""
    config.save_pretrained(tmp_path)
    return tmp_path


def test_refusals_name_the_architecture_and_reason(tmp_path: Path) -> None:
    import transformers as tf

    cases = {
        "T5ForConditionalGeneration": (
            tf.T5Config(architectures=["T5ForConditionalGeneration"]),
            "encoder-decoder",
        ),
        "MambaForCausalLM": (
            tf.MambaConfig(architectures=["MambaForCausalLM"]),
            "hybrid or linear-attention",
        ),
        "Qwen3NextForCausalLM": (
            tf.Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], num_hidden_layers=4),
            "hybrid or linear-attention",
        ),
        "BloomForCausalLM": (
            tf.BloomConfig(architectures=["BloomForCausalLM"]),
            "_supports_attention_backend is False",
        ),
    }
    for arch, (config, reason) in cases.items():
        model_dir = _config_only(tmp_path / arch, config)
        with pytest.raises(ValueError, match=reason) as info:
            load_model_config(model_dir)
        assert arch in str(info.value)
        with pytest.raises(ValueError, match=reason):
            LLMEngine(EngineConfig(model=str(model_dir)))


def test_native_impl_refuses_an_architecture_without_a_native_class(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = build_tiny_model("phi3", tmp_path, tiny_model_dir)
    with pytest.raises(ValueError, match="Phi3ForCausalLM has no native implementation"):
        load_model_config(model_dir, "native")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"]


def test_app_config_model_impl_reaches_both_pools() -> None:
    from pdserve.deployments.config import AppConfig
    from pdserve.deployments.engine_factory import engine_config

    cfg = AppConfig.from_dict({"model": {"impl": "transformers"}})
    for role in ("prefill", "decode"):
        assert engine_config(cfg, role, "/models/m").model_impl == "transformers"
    with pytest.raises(ValueError, match="impl"):
        AppConfig.from_dict({"model": {"impl": "vllm"}})
