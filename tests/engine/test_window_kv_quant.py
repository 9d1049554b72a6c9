"""The window pool over an int8 / float8 KV cache: tiny gpt-oss (window 32) and Gemma 3
(window 40) built by transformers keep their window layers' quantized KV in a pool of their
own, with the same per-layer scales as the engine whose window layers keep every block in
the one pool; prompts far longer than the window and the tokens generated after them equal
that engine's, under the default budget and under a 32-token chunked-prefill budget with
preemption, while each sequence holds at most ``cdiv(W + chunk, B) + 1`` window blocks."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_cache_manager import cdiv
from pdserve.engine.llm_engine import LLMEngine
from tests.engine.transformers_reference import tiny_models_fixture
from tests.engine.window_runs import SCHEDULES, WINDOW_MODELS, run_holding, schedule_setup

B = 16
NUM_NEW = 40
window_model = tiny_models_fixture(WINDOW_MODELS, "window-quant")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_quantized_window_pool_matches_the_one_pool(window_model, kv_dtype, schedule) -> None:
    model_dir, ref = window_model
    config, arrivals, chunk = schedule_setup(model_dir, schedule, kv_cache_dtype=kv_dtype)
    windowed = LLMEngine(config)
    one_pool = LLMEngine(config.model_copy(update={"window_kv_pool": False}))
    layout = windowed.window_layout
    assert layout is not None and one_pool.window_layout is None
    assert windowed.runner.window_kv_cache.dtype == windowed.kv_cache.dtype != torch.float32
    # The same scales, each pool registered with its own layers' rows.
    scales = one_pool.kv_scales
    assert scales is not None and torch.equal(windowed.runner.kv_scales, scales)
    full = layout.full_layers(scales.shape[0])
    assert torch.equal(windowed.kv_scales, scales[list(full)])
    assert torch.equal(windowed.window_kv_scales, scales[list(layout.layers)])

    got, most = run_holding(windowed, arrivals, ref.vocab_size, NUM_NEW)
    want, _ = run_holding(one_pool, arrivals, ref.vocab_size, NUM_NEW)
    assert sorted(got) == sorted(want) == [f"r{i}" for i in range(len(arrivals))]
    for rid, out in want.items():
        assert got[rid].token_ids == out.token_ids, rid
        assert got[rid].logprobs is not None and out.logprobs is not None
        for a, b in zip(got[rid].logprobs, out.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) <= 1e-5, rid
    assert most[0] <= cdiv(layout.window + chunk, B) + 1
    assert 0 < most[1] <= cdiv(layout.window + 1, B) + 1  # one token a step: its window
    if schedule != "default":
        assert windowed.stats().num_preemptions > 0, "the pool was meant to force preemption"
