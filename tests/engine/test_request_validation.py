"""Bad input is rejected with ValueError naming the field, and leaves the engine untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 4}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_stop() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0).greedy


def test_engine_config_forbids_unknown_and_bad_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_num_seq"):
        EngineConfig(model="m", max_num_seq=4)  # misspelt
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model="m", block_size=0)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        EngineConfig(model="m", num_kv_blocks=2, block_size=16, max_model_len=64)
    path = tmp_path / "engine.yaml"
    path.write_text("model: /m\nblock_size: 32\nmax_num_seqs: 8\n")
    cfg = EngineConfig.from_yaml(path)
    assert cfg.block_size == 32 and cfg.max_num_seqs == 8


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine.from_pretrained(
        tiny_model_dir, num_kv_blocks=32, block_size=16, max_model_len=128, device="cpu"
    )


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ("", "prompt"),
        ([], "prompt"),
        ([1, 2, -3], "prompt"),
        ([1, 10**9], "prompt"),
        ([1, True], "prompt"),
        (list(range(129)), "max_model_len"),
        (42, "prompt"),
    ],
)
def test_engine_rejects_bad_prompts(engine: LLMEngine, prompt: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt)  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_engine_rejects_bad_ids_and_params(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("", [1, 2, 3])
    with pytest.raises(ValueError, match="params"):
        engine.add_request("x", [1, 2, 3], {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_prior_output_tokens"):
        engine.add_request("x", [1, 2, 3], SamplingParams(num_prior_output_tokens=3))
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", [4, 5, 6])
    with pytest.raises(ValueError, match="request_id"):
        engine.reserve_remote_prefill("dup", [4, 5, 6])
    assert engine.stats().num_waiting == 1
    engine.abort("dup")
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_prompt_of_exactly_max_model_len_gets_one_token(engine: LLMEngine) -> None:
    (out,) = engine.generate([[5] * 128], SamplingParams(max_tokens=10, temperature=0))
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    engine.check_integrity()


def test_remote_hooks_reject_unknown_requests(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="request_id"):
        engine.complete_remote_prefill("nope", 1)
    with pytest.raises(ValueError, match="request_id"):
        engine.fail_remote_prefill("nope")
    assert engine.reserve_remote_prefill("r", [1, 2, 3]) is not None
    with pytest.raises(ValueError, match="first_token_id"):
        engine.complete_remote_prefill("r", -5)
    assert engine.abort("r") is not None
    engine.check_integrity()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_generate_validates_every_prompt_before_queueing(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([[1, 2, 3], [], [4, 5]], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_generate_raises_instead_of_hanging_when_the_pool_is_held(engine: LLMEngine) -> None:
    held = [f"hold{i}" for i in range(4)]
    for rid in held:  # 4 x 128 tokens = all 32 blocks reserved for remote KV
        assert engine.reserve_remote_prefill(rid, [7] * 128) is not None
    assert engine.stats().num_free_blocks == 0
    with pytest.raises(RuntimeError, match="scheduled"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert engine.stats().num_waiting == 0  # the generate request was aborted
    for rid in held:
        engine.abort(rid)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    engine.check_integrity()
