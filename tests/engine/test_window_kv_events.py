"""KV events of an engine whose window layers keep a pool of their own: both pools report
the blocks they cache, in the order they cached them, and the window pool reports a block
removed when it is evicted (a block that falls out of a running sequence's window goes back
to the pool still cached, reusable by a prefix hit, until then). Applying the events to an
empty set gives exactly what each pool caches, so a router indexing them sees what the
engine can reuse."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from tests.engine.transformers_reference import make_prompt, run, tiny_models_fixture
from tests.engine.window_events import B, LoggedWindowManager

GREEDY = SamplingParams(max_tokens=1)
gpt_oss = tiny_models_fixture({"gpt-oss": ("gpt-oss", {"swiglu_limit": 1.5})}, "window-events")


def test_a_logs_events_cancel_within_a_drain() -> None:
    log = KVEventLog()
    log.stored(1)
    log.removed(1)  # stored, then evicted: only the removal is news
    log.removed(2)
    log.stored(2)  # evicted, then cached again: held at the end
    log.stored(3)
    events = log.drain()
    assert events.stored == (2, 3) and events.removed == (1,)
    assert log.drain().stored == ()


def test_both_pools_report_their_blocks_in_order_and_evictions_of_window_blocks() -> None:
    """Window 32 (a hit needs its last 2 blocks in the window pool), 5 usable window blocks,
    a 200-token prompt in 16-token steps: the window pool caches every block as it fills and
    evicts them oldest first once it runs out."""
    m = LoggedWindowManager(window=32, num_window_blocks=6)
    assert m.window.hit_blocks == 2
    drains = []
    request = m.compute(
        "a", list(range(1000, 1200)), chunk=16, after_step=lambda: drains.append(m.drain())
    )
    hashes = request.block_hashes[:12]  # 200 tokens: 12 full blocks
    full_stored = [h for e in drains for h in e.stored]
    window_stored = [h for e in drains for h in e.window_stored]
    window_removed = [h for e in drains for h in e.window_removed]
    assert full_stored == hashes and not any(e.removed for e in drains)
    assert window_stored == hashes
    assert window_removed == hashes[:8]  # the oldest first; 8..11 still cached
    for i, h in enumerate(hashes[:8]):  # each removed in a later step than it was stored
        stored_at = next(k for k, e in enumerate(drains) if h in e.window_stored)
        removed_at = next(k for k, e in enumerate(drains) if h in e.window_removed)
        assert stored_at == i < removed_at
    assert set(m.window.pool.cached_hashes()) == set(hashes[8:])
    # What the pools hold is what a prefix hit takes: its last 2 blocks' window too.
    for length, hit in ((200, 12), (176, 11), (150, 0)):
        probe = Request(f"p{length}", [*range(1000, 1000 + length), 7], GREEDY, 0.0)
        assert m.kv.get_computed_blocks(probe)[1] == hit * B, length


def test_an_engine_publishes_both_pools_and_a_reset_clears_them(gpt_oss) -> None:
    """Tiny gpt-oss (window 32) with one seat and 32-token chunks: its window pool has 7
    blocks, so a 300-token prompt evicts most of its own window blocks. One drain after it
    holds, for each pool, exactly the hashes the pool caches, in the order cached."""
    model_dir, ref = gpt_oss
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), max_num_seqs=1, max_num_batched_tokens=32)
    )
    window = engine.kv_cache_manager.window
    assert window is not None and engine.window_kv_events is not None
    assert window.pool.num_blocks == 7
    prompt = make_prompt(300, seed=41, vocab=ref.vocab_size)
    run(engine, [(0, "a", prompt)], logprobs=0, num_new=4)
    events = engine.drain_kv_events()
    full = engine.kv_cache_manager.pool.cached_hashes()
    assert list(events.stored) == full and len(full) == 303 // B and not events.removed
    cached = window.pool.cached_hashes()
    assert 0 < len(cached) < window.pool.num_blocks and set(events.window_stored) == set(cached)
    order = {h: i for i, h in enumerate(full)}  # the chain order: block i's hash is i-th
    assert sorted(events.window_stored, key=order.__getitem__) == list(events.window_stored)
    assert events.window_removed and not set(events.window_removed) & set(cached)
    assert set(events.window_removed) | set(cached) == set(full)  # every block, once
    engine.reset_prefix_cache()
    cleared = engine.drain_kv_events()
    assert cleared.cleared and not cleared.stored and not cleared.window_stored
