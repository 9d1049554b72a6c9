"""The window pool over an int8 / float8 KV cache: tiny gpt-oss (window 32) and Gemma 3
(window 40) built by transformers keep their window layers' quantized KV in a pool of their
own, with the same per-layer scales as the engine whose window layers keep every block in
the one pool; prompts far longer than the window and the tokens generated after them equal
that engine's, under the default budget and under a 32-token chunked-prefill budget with
preemption, while each sequence holds at most ``cdiv(W + chunk, B) + 1`` window blocks."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import cdiv
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from tests.engine.transformers_reference import (
    GEMMA3_TINY,
    PREEMPT_ARRIVALS,
    assert_clean,
    make_prompt,
    small_pool_config,
    tiny_models_fixture,
)

B = 16
NUM_NEW = 40
LONG = [(0, 600), (0, 45), (1, 300), (2, 1)]  # the default budget's arrivals
MODELS = {"gpt-oss": ("gpt-oss", {"swiglu_limit": 1.5}), "gemma3": GEMMA3_TINY}
window_model = tiny_models_fixture(MODELS, "window-quant")


def _run(
    engine: LLMEngine, schedule: list[tuple[int, int]], vocab: int
) -> tuple[dict[str, RequestOutput], tuple[int, int]]:
    """The schedule's seeded prompts at their steps, greedy; the final outputs and the most
    window blocks a request held after a step, overall and after a one-token decode step
    (0, 0 without a window pool)."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1)
    window = engine.kv_cache_manager.window
    final: dict[str, RequestOutput] = {}
    most = [0, 0]
    computed: dict[str, int] = {}
    for step in range(3000):
        for i, (at, n) in enumerate(schedule):
            if at == step:
                engine.add_request(f"r{i}", make_prompt(n, seed=i, vocab=vocab), params)
        if step > schedule[-1][0] and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        for i in range(len(schedule) if window is not None else 0):
            request = engine.scheduler.get_request(f"r{i}")
            if request is not None:
                held = window.num_held(request)
                n = request.num_computed_tokens
                decoding = n == computed.get(request.request_id, -1) + 1 == request.num_tokens - 1
                computed[request.request_id] = n
                most = [max(most[0], held), max(most[1], held if decoding else 0)]
    else:
        raise AssertionError("the engine did not finish")
    assert_clean(engine)
    return final, (most[0], most[1])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("schedule", ["default", "chunked-preempt"])
def test_quantized_window_pool_matches_the_one_pool(window_model, kv_dtype, schedule) -> None:
    model_dir, ref = window_model
    if schedule == "default":
        config, arrivals, chunk = EngineConfig(model=str(model_dir)), LONG, 600
    else:
        config, arrivals, chunk = small_pool_config(model_dir), PREEMPT_ARRIVALS, 32
    config = config.model_copy(update={"kv_cache_dtype": kv_dtype})
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

    got, most = _run(windowed, arrivals, ref.vocab_size)
    want, _ = _run(one_pool, arrivals, ref.vocab_size)
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
