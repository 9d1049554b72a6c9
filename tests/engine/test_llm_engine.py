"""LLMEngine on the tiny generated model: batching, chunking, preemption and the prefix
cache must not change the tokens; aborts and role hooks must not leak blocks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from tests.engine.fakes import RecordingConnector

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(length + 3 * i)] for i in range(n)]


def _engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    cfg: dict[str, Any] = dict(num_kv_blocks=64, block_size=16, max_model_len=256, device="cpu")
    cfg.update(overrides)
    return LLMEngine.from_pretrained(model_dir, **cfg)


def _assert_idle(engine: LLMEngine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_running == stats.num_waiting == stats.num_sending_kv == 0
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return _engine(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(engine: LLMEngine) -> dict[int, list[int]]:
    """Greedy tokens of each prompt run alone (no batching, no cache hits)."""
    engine.reset_prefix_cache()
    out = {}
    for i, prompt in enumerate(_prompts(3, 12)):
        engine.reset_prefix_cache()
        out[i] = engine.generate([prompt], GREEDY)[0].token_ids
    return out


def test_batching_and_chunked_prefill_keep_tokens(
    tiny_model_dir: Path, engine: LLMEngine, reference: dict[int, list[int]]
) -> None:
    prompts = _prompts(3, 12)
    batched = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == [reference[i] for i in range(3)]
    chunked = _engine(tiny_model_dir, max_num_batched_tokens=8, max_num_seqs=2)
    outs = chunked.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [reference[i] for i in range(3)]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)
    _assert_idle(chunked)
    _assert_idle(engine)


def test_preemption_keeps_greedy_and_seeded_tokens(tiny_model_dir: Path, engine: LLMEngine) -> None:
    prompts = _prompts(3, 10, seed=1)
    params = [
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.8, top_k=50, seed=8, ignore_eos=True),
    ]
    engine.reset_prefix_cache()
    roomy = engine.generate(prompts, params)
    # Each request starts in one 16-token block and grows into a second; the pool has 4.
    tight = _engine(tiny_model_dir, num_kv_blocks=4, max_model_len=64)
    outs = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    assert any(o.num_preemptions for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    _assert_idle(tight)


def test_prefix_cache_hit_is_reported_and_changes_nothing(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    engine.reset_prefix_cache()
    base = _prompts(1, 40, seed=2)[0]
    (first,) = engine.generate([base], GREEDY)
    assert first.num_cached_tokens == 0
    (second,) = engine.generate([base + [100, 200, 300]], GREEDY)
    assert second.num_cached_tokens == 32  # two full 16-token blocks of the 40-token prefix
    assert engine.stats().prefix_cache_hits >= 32
    uncached = _engine(tiny_model_dir, enable_prefix_caching=False)
    (ref,) = uncached.generate([base + [100, 200, 300]], GREEDY)
    assert ref.num_cached_tokens == 0
    assert second.token_ids == ref.token_ids
    _assert_idle(engine)


def test_abort_mid_generation_frees_blocks(engine: LLMEngine) -> None:
    engine.add_request("a", _prompts(1, 50, seed=3)[0], SamplingParams(max_tokens=100))
    engine.add_request("b", _prompts(1, 10, seed=4)[0], SamplingParams(max_tokens=100))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_total_blocks
    out = engine.abort("a")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert 0 < len(out.token_ids) < 100
    engine.abort("b")
    assert engine.abort("b") is None
    _assert_idle(engine)


def test_stop_string_and_stop_token(engine: LLMEngine) -> None:
    prompt = "The quick brown fox"
    free_params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    (free,) = engine.generate([prompt], free_params)
    text = free.text
    # A stop string from the middle of the free-running text, not at its start.
    start = next(i for i in range(3, len(text) - 3) if text[i : i + 3].strip() == text[i : i + 3])
    stop = text[start : start + 3]
    cut = text.find(stop)
    (stopped,) = engine.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:cut]
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]

    third = free.token_ids[2]
    (by_id,) = engine.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[third])
    )
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(third) + 1]
    _assert_idle(engine)


def test_streamed_deltas_add_up(engine: LLMEngine) -> None:
    engine.add_request("s", "Once upon a time", SamplingParams(max_tokens=10, logprobs=3))
    deltas: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        deltas += [o for o in engine.step() if o.request_id == "s"]
    final = deltas[-1]
    assert final.finished and sum(len(o.new_token_ids) for o in deltas) == len(final.token_ids)
    assert "".join(o.text_delta for o in deltas) == final.text
    lps = [lp for o in deltas for lp in (o.logprobs or [])]
    assert [lp.token_id for lp in lps] == final.token_ids
    assert all(lp.top_logprobs is not None and len(lp.top_logprobs) == 3 for lp in lps)
    assert all(lp.logprob <= 0.0 for lp in lps)
    _assert_idle(engine)


def test_stats_report_queued_prefill_tokens(engine: LLMEngine) -> None:
    engine.add_request("q1", [7] * 30, SamplingParams(max_tokens=2))
    engine.add_request("q2", [9] * 20, SamplingParams(max_tokens=2))
    stats = engine.stats()
    assert stats.num_waiting == 2 and stats.queued_prefill_tokens == 50
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1))  # drives q1, q2 as well
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.queued_prefill_tokens == 0 and stats.prefill_tokens_per_s > 0
    _assert_idle(engine)


def test_prefill_to_decode_handoff_matches_local_generation(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    prompt = _prompts(1, 37, seed=5)[0]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    (local,) = engine.generate([prompt], params)

    connector = RecordingConnector()
    prefill = _engine(tiny_model_dir, kv_connector=connector, max_num_batched_tokens=16)
    # The engine registered its pool, once allocated, with the model's identity.
    ((pool, model_name),) = connector.registered
    assert pool is prefill.kv_cache and model_name == tiny_model_dir.name
    decode = _engine(tiny_model_dir)
    dst = decode.reserve_remote_prefill("r", prompt, params)
    assert dst is not None and len(dst) == 3
    assert decode.stats().num_waiting_remote_kv == 1

    prefill.add_request("r", prompt, params, prefill_only=True)
    outs: list[RequestOutput] = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    (first,) = outs
    assert first.finished and first.token_ids == local.token_ids[:1]
    # 37 tokens in chunks of 16, 16 and 5: each step sends the block its chunk completed.
    sends = connector.begun
    assert [s.request_id for s in sends] == ["r"] * 3
    assert [(s.block_offset, len(s.block_ids), s.final) for s in sends] == [
        (0, 1, False),
        (1, 1, False),
        (2, 1, True),
    ]
    assert all(s.num_tokens == 37 for s in sends)
    src = [b for s in sends for b in s.block_ids]
    n_layers = prefill.model_config.num_layers
    assert sorted(set(connector.layers)) == list(range(n_layers))
    # The send is in flight: the prefill engine still holds the blocks.
    assert prefill.stats().num_sending_kv == 1
    # "Transfer": copy the blocks, as kvtransfer would.
    decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]
    connector.done.append("r")
    prefill.step()
    _assert_idle(prefill)

    decode.complete_remote_prefill("r", first.token_ids[0])
    streamed: list[RequestOutput] = []
    while decode.has_unfinished_requests():
        streamed += decode.step()
    assert streamed[0].new_token_ids == local.token_ids[:1]
    assert streamed[-1].token_ids == local.token_ids
    assert streamed[-1].text == local.text
    _assert_idle(decode)


def test_failed_remote_prefill_recomputes_locally(engine: LLMEngine) -> None:
    prompt = _prompts(1, 25, seed=6)[0]
    engine.reset_prefix_cache()
    (local,) = engine.generate([prompt], GREEDY)
    engine.reset_prefix_cache()
    blocks = engine.reserve_remote_prefill("f", prompt, GREEDY)
    assert blocks is not None
    engine.fail_remote_prefill("f")
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o
    assert final is not None and final.token_ids == local.token_ids
    _assert_idle(engine)
