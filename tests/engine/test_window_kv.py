"""Sliding-window layers keep only their window's KV, in a pool of their own.

The block tables first (pure Python): a sequence far longer than the window holds a bounded
number of window blocks while its full-attention blocks grow with it; a prefix hit takes
the window pool's cached blocks for the window before the hit only, is shortened where
those were evicted, and never hands out a freed block. Then tiny random gpt-oss and Gemma 3
models built by transformers (windows of 32 and 40 tokens): prompts of up to 600 tokens and
80 generated tokens give transformers' float32 greedy tokens and logprobs under the default
budget and under a 32-token chunked-prefill budget with preemption, prefix caching on; a
long sequence's window blocks stay bounded while it runs; a second request sharing a prefix
longer than the window hits the cache and still matches transformers.
"""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager, cdiv
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.window_kv import NULL_BLOCK, WindowKV, window_pool_blocks
from tests.engine.transformers_reference import (
    GEMMA3_TINY,
    PREEMPT_ARRIVALS,
    assert_clean,
    assert_matches,
    check_schedule,
    make_prompt,
    run,
    small_pool_config,
    tiny_models_fixture,
)

B = 16


def _manager(window: int, num_blocks: int = 400, num_window_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(num_blocks, B, True, WindowKV(window, B, num_window_blocks, True))


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1), 0.0)


def _advance(kv: KVCacheManager, request: Request, n: int) -> None:
    """Schedule ``n`` tokens of the request and mark them computed."""
    assert kv.allocate_slots(request, n) is not None
    request.num_computed_tokens += n
    kv.cache_full_blocks(request)


def _compute(kv: KVCacheManager, request: Request, chunk: int) -> int:
    """Compute the whole prompt in chunks; returns the most window blocks held at once."""
    most = 0
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        _advance(kv, request, n)
        assert kv.window is not None
        most = max(most, kv.window.num_held(request))
    return most


@pytest.mark.parametrize("chunk", [1, 7, 48])
def test_a_long_sequence_holds_only_its_window(chunk: int) -> None:
    window = 64
    kv = _manager(window)
    request = _request("a", list(range(1000)))
    most = _compute(kv, request, chunk)
    assert len(request.block_ids) == cdiv(1000, B)  # the full layers keep everything
    assert len(request.window_block_ids) == len(request.block_ids)
    assert most <= cdiv(window + chunk, B) + 1
    # Scheduled on, every block a next token at 1000 attends is held, every older one freed.
    assert kv.allocate_slots(request, 0) == []
    first = (1000 - window + 1) // B
    assert all(b == NULL_BLOCK for b in request.window_block_ids[:first])
    assert NULL_BLOCK not in request.window_block_ids[first:]
    kv.check_integrity([request])
    kv.free(request)
    kv.check_integrity([])
    assert kv.window is not None and kv.window.pool.num_free_blocks == 63  # all but null


def test_a_prefix_hit_takes_the_cached_window_and_never_a_freed_block() -> None:
    window = 40
    kv = _manager(window, num_window_blocks=20)
    prompt = list(range(300))
    first = _request("first", prompt)
    _compute(kv, first, 32)
    kv.free(first)  # its blocks stay cached (full and window alike)

    second = _request("second", prompt[:288] + [9999] * 30)
    hits, num_tokens = kv.get_computed_blocks(second)
    assert num_tokens == 288  # 18 full blocks, and the window pool holds the window's
    assert kv.allocate_slots(second, second.num_tokens - num_tokens, hits) is not None
    lo = (288 - window + 1) // B
    assert second.window_block_ids[:lo] == [NULL_BLOCK] * lo
    assert all(b != NULL_BLOCK for b in second.window_block_ids[lo:])
    kv.check_integrity([second])
    kv.free(second)

    # Evict the window pool's cache: one chunk of another request takes every window block.
    hog = _request("hog", [7] * 16 * 19)
    assert kv.allocate_slots(hog, 16 * 19) is not None
    third = _request("third", prompt[:288] + [5] * 30)
    hits, num_tokens = kv.get_computed_blocks(third)
    assert num_tokens == 0  # full blocks are cached, their window is gone: no hit
    assert kv.allocate_slots(third, third.num_tokens, hits) is None  # and no room either
    kv.check_integrity([hog])


def test_the_window_pool_fits_every_seat() -> None:
    n = window_pool_blocks(512, 16, max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=8192)
    assert n == 8 * (32 + 2) + 128 + 1
    small = window_pool_blocks(512, 16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    assert small == 8 * 4 + 1  # never more than the sequences could fill without a window


# ---------------------------------------------------------------------------- engines

NUM_NEW = 80
SCHEDULE = [(0, 600), (0, 1), (0, 45), (1, 130), (3, 300)]
MODELS = {"gpt-oss": ("gpt-oss", {"swiglu_limit": 1.5}), "gemma3": GEMMA3_TINY}
window_model = tiny_models_fixture(MODELS, "window")


def _window_engine(config: EngineConfig) -> LLMEngine:
    engine = LLMEngine(config)
    layout = engine.window_layout
    assert layout is not None, "the window layers were meant to get a pool of their own"
    runner = engine.runner
    full_layers = runner.model_config.num_layers - len(layout.layers)
    assert engine.kv_cache.shape[0] == full_layers
    assert runner.window_kv_cache.shape[:3] == (len(layout.layers), 2, layout.num_blocks)
    return engine


def test_default_schedule_matches_transformers(window_model) -> None:
    model_dir, ref = window_model
    engine = _window_engine(EngineConfig(model=str(model_dir)))
    check_schedule(engine, ref, SCHEDULE, NUM_NEW, "native")


def test_chunked_prefill_and_preemption_match_transformers(window_model) -> None:
    model_dir, ref = window_model
    engine = _window_engine(small_pool_config(model_dir))
    check_schedule(engine, ref, PREEMPT_ARRIVALS, 40, "native")  # 600 + 40 = max_model_len
    assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"


def test_a_long_sequence_holds_a_bounded_window(window_model) -> None:
    model_dir, ref = window_model
    budget = 32
    engine = _window_engine(EngineConfig(model=str(model_dir), max_num_batched_tokens=budget))
    window = engine.kv_cache_manager.window
    assert window is not None
    prompt = make_prompt(500, seed=11, vocab=ref.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=2)
    engine.add_request("long", prompt, params)
    most, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        request = engine.scheduler.get_request("long")
        if request is not None:
            most = max(most, window.num_held(request))
            assert len(request.block_ids) == cdiv(request.num_computed_tokens, B)
    assert out is not None and out.finished
    assert most <= cdiv(window.window + budget, B) + 1
    assert out.token_ids == ref.generate(prompt, NUM_NEW)
    assert_clean(engine)


def test_a_shared_prefix_longer_than_the_window_hits_and_matches(window_model) -> None:
    model_dir, ref = window_model
    engine = _window_engine(EngineConfig(model=str(model_dir)))
    prefix = make_prompt(400, seed=21, vocab=ref.vocab_size)
    first = prefix + make_prompt(20, seed=22, vocab=ref.vocab_size)
    second = prefix + make_prompt(37, seed=23, vocab=ref.vocab_size)
    final = run(engine, [(0, "first", first)], num_new=NUM_NEW)
    assert engine.cached_prefix_tokens(second) == 400
    final |= run(engine, [(0, "second", second)], num_new=NUM_NEW)
    window = engine.kv_cache_manager.window
    assert window is not None
    assert final["second"].num_cached_tokens == 400 > window.window
    assert_matches(ref, first, final["first"], NUM_NEW)
    assert_matches(ref, second, final["second"], NUM_NEW)
    assert_clean(engine)


def test_off_every_layer_keeps_the_whole_sequence(window_model) -> None:
    """``window_kv_pool=False`` (what a KV connector implies): one pool of every layer, the
    layout the P/D hand-off moves; a window-pool engine refuses a remote prefill."""
    model_dir, ref = window_model
    engine = LLMEngine(EngineConfig(model=str(model_dir), window_kv_pool=False))
    assert engine.window_layout is None and engine.kv_cache_manager.window is None
    assert engine.kv_cache.shape[0] == engine.runner.model_config.num_layers
    check_schedule(engine, ref, SCHEDULE[:2], 8, "native")
    windowed = _window_engine(EngineConfig(model=str(model_dir)))
    with pytest.raises(ValueError, match="window_kv_pool=False"):
        windowed.reserve_remote_prefill("remote", [5] * 40)
    stats = windowed.stats()
    assert stats.num_window_total_blocks == windowed.kv_cache_manager.window.pool.num_blocks - 1
    assert stats.num_window_free_blocks == stats.num_window_total_blocks


def test_a_pool_sized_for_the_seats_alone_serves_long_requests(window_model) -> None:
    """Two seats, 32-token chunks: the window pool has just the blocks two sequences'
    windows need, and long requests queued behind each other still finish and match."""
    model_dir, ref = window_model
    config = EngineConfig(
        model=str(model_dir), max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=120
    )
    engine = _window_engine(config)
    window = engine.kv_cache_manager.window
    assert window is not None
    per_seq = cdiv(window.window, B) + 2
    assert window.pool.num_blocks == 2 * per_seq + 32 // B + 1
    check_schedule(engine, ref, [(0, 300), (0, 250), (1, 170), (2, 9)], 40, "native")
