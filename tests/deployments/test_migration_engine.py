"""A migrated stream continues as the uninterrupted run would, on a real engine (no cluster).

The request runs once whole; then its first k tokens are taken as streamed, the request is
rebuilt as ``migration.continuation`` sends it to another replica and run on a fresh engine.
The streamed tokens plus the continuation's must equal the whole run's, for seeded sampling
with penalties and for JSON mode (the grammar must catch up on the tokens sent before)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.deployments.messages import GenerateRequest, SamplingOptions
from pdserve.deployments.migration import continuation
from pdserve.engine.llm_engine import LLMEngine

PROMPT = [17, 301, 45, 999, 12, 640, 7]


def _engine(model_dir: Path) -> LLMEngine:
    return LLMEngine.from_pretrained(
        model_dir, num_kv_blocks=64, block_size=16, max_model_len=256, device="cpu"
    )


def _run(model_dir: Path, req: GenerateRequest) -> list[int]:
    engine = _engine(model_dir)  # a fresh engine stands for another replica
    (out,) = engine.generate([req.prompt_token_ids], req.sampling.to_params())
    return list(out.token_ids)


CASES = {
    "seeded": SamplingOptions(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True),
    "seeded_top_k_penalties": SamplingOptions(
        max_tokens=24,
        temperature=0.9,
        top_k=40,
        seed=7,
        ignore_eos=True,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        repetition_penalty=1.3,
        min_tokens=20,
    ),
    "seeded_json_mode": SamplingOptions(max_tokens=40, temperature=1.0, seed=3, json_object=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cut", [1, 9])
def test_a_continued_stream_equals_the_uninterrupted_run(
    tiny_model_dir: Path, name: str, cut: int
) -> None:
    req = GenerateRequest(request_id=f"{name}-{cut}", prompt_token_ids=PROMPT, sampling=CASES[name])
    whole = _run(tiny_model_dir, req)
    assert len(whole) > cut
    streamed = whole[:cut]
    rest = _run(tiny_model_dir, continuation(req, streamed))
    assert streamed + rest == whole


def test_a_second_migration_counts_every_token_before_it(tiny_model_dir: Path) -> None:
    req = GenerateRequest(request_id="twice", prompt_token_ids=PROMPT, sampling=CASES["seeded"])
    whole = _run(tiny_model_dir, req)
    first = continuation(req, whole[:5])
    assert first.sampling.num_prior_output_tokens == 5
    # The ingress always continues from the original request and everything streamed.
    second = continuation(req, whole[:13])
    assert second.sampling.num_prior_output_tokens == 13
    assert whole[:13] + _run(tiny_model_dir, second) == whole


def test_without_the_offset_the_seeded_continuation_would_differ(tiny_model_dir: Path) -> None:
    """The check above can fail: a continuation that forgets the tokens before it samples
    other tokens."""
    req = GenerateRequest(request_id="plain", prompt_token_ids=PROMPT, sampling=CASES["seeded"])
    whole = _run(tiny_model_dir, req)
    cont = continuation(req, whole[:9])
    naive = cont.model_copy(
        update={"sampling": cont.sampling.model_copy(update={"num_prior_output_tokens": 0})}
    )
    assert whole[:9] + _run(tiny_model_dir, naive) != whole
