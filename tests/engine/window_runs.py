"""Running a schedule on an engine with a window pool while watching the window blocks each
request holds (shared by the window-pool tests)."""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from tests.engine.transformers_reference import (
    GEMMA3_TINY,
    PREEMPT_ARRIVALS,
    assert_clean,
    make_prompt,
    small_pool_config,
)

# Tiny models mixing window and full layers (windows of 32 and 40 tokens).
WINDOW_MODELS = {"gpt-oss": ("gpt-oss", {"swiglu_limit": 1.5}), "gemma3": GEMMA3_TINY}
SCHEDULES = ["default", "chunked-preempt"]
_LONG = [(0, 600), (0, 45), (1, 300), (2, 1)]  # the default budget's arrivals


def schedule_setup(
    model_dir: Path, schedule: str, **overrides: object
) -> tuple[EngineConfig, list[tuple[int, int]], int]:
    """An engine config (with ``overrides``), its (step, prompt length) arrivals and its
    longest chunk: ``default`` (one step takes a 600-token prompt) or ``chunked-preempt``
    (a 32-token budget and a pool small enough to force preemption)."""
    if schedule == "default":
        config, arrivals, chunk = EngineConfig(model=str(model_dir)), _LONG, 600
    else:
        config, arrivals, chunk = small_pool_config(model_dir), PREEMPT_ARRIVALS, 32
    return config.model_copy(update=overrides), arrivals, chunk


def run_holding(
    engine: LLMEngine, schedule: list[tuple[int, int]], vocab: int, num_new: int
) -> tuple[dict[str, RequestOutput], tuple[int, int]]:
    """The schedule's seeded prompts (``f"r{i}"``) at their steps, greedy with two top
    logprobs; the final outputs (every logprob streamed) and the most
    window blocks a request held after a step, overall and after a one-token decode step
    (0, 0 without a window pool)."""
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True, logprobs=2)
    window = engine.kv_cache_manager.window
    final: dict[str, RequestOutput] = {}
    logprobs: dict[str, list] = {}
    most = [0, 0]
    computed: dict[str, int] = {}
    for step in range(3000):
        for i, (at, n) in enumerate(schedule):
            if at == step:
                engine.add_request(f"r{i}", make_prompt(n, seed=i, vocab=vocab), params)
        if step > schedule[-1][0] and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
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
    for rid, out in final.items():  # the streamed deltas, concatenated: what a client sees
        object.__setattr__(out, "logprobs", logprobs[rid])
    return final, (most[0], most[1])
