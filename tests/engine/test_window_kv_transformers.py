"""The window pool on the transformers-backed path: tiny gpt-oss (window 32) and Gemma 3
(window 40) built by transformers, run by transformers' own modelling code with pdserve's
attention hook (``model_impl="transformers"``), keep their window layers' KV in a pool of
their own, each window layer on the window pool's slots and table. Prompts far longer than
the window and 40 generated tokens give transformers' float32 greedy tokens and logprobs
under the default budget and under a 32-token chunked-prefill budget with preemption, while
each sequence holds at most ``cdiv(W + chunk, B) + 1`` window blocks."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_cache_manager import cdiv
from pdserve.engine.llm_engine import LLMEngine
from tests.engine.transformers_reference import assert_matches, make_prompt, tiny_models_fixture
from tests.engine.window_runs import SCHEDULES, WINDOW_MODELS, run_holding, schedule_setup

B = 16
NUM_NEW = 40
window_model = tiny_models_fixture(WINDOW_MODELS, "window-hf")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_transformers_path_window_pool_matches_transformers(window_model, schedule) -> None:
    model_dir, ref = window_model
    config, arrivals, chunk = schedule_setup(model_dir, schedule, model_impl="transformers")
    engine = LLMEngine(config)
    runner = engine.runner
    assert runner.model_config.impl == "transformers"
    layout = engine.window_layout
    assert layout is not None, "the window layers were meant to get a pool of their own"
    assert engine.kv_cache.shape[0] == runner.model_config.num_layers - len(layout.layers)
    assert runner.window_kv_cache.shape[:3] == (len(layout.layers), 2, layout.num_blocks)

    final, most = run_holding(engine, arrivals, ref.vocab_size, NUM_NEW)
    for i, (_, n) in enumerate(arrivals):
        assert_matches(ref, make_prompt(n, seed=i, vocab=ref.vocab_size), final[f"r{i}"], NUM_NEW)
    assert most[0] <= cdiv(layout.window + chunk, B) + 1
    assert 0 < most[1] <= cdiv(layout.window + 1, B) + 1  # one token a step: its window
    if schedule != "default":
        assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
