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


def _stream(
    model_dir: Path, req: GenerateRequest, stop_after: int | None = None
) -> tuple[list[int], str, str | None]:
    """Tokens, streamed text and finish reason of ``req`` on a fresh engine, step by step as
    a replica streams it; ``stop_after``: the replica dies once that many tokens are out."""
    engine = _engine(model_dir)
    engine.add_request(req.request_id, req.prompt_token_ids, req.sampling.to_params())
    tokens: list[int] = []
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.text_delta
            if out.finished:
                return tokens, text, out.finish_reason
        if stop_after is not None and len(tokens) >= stop_after:
            engine.abort(req.request_id)
            return tokens, text, None
    raise AssertionError("the request never finished")


GREEDY = SamplingOptions(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("cut", [1, 5, 9])
def test_a_continued_stream_streams_the_uninterrupted_text(tiny_model_dir: Path, cut: int) -> None:
    req = GenerateRequest(request_id=f"text-{cut}", prompt_token_ids=PROMPT, sampling=GREEDY)
    whole, whole_text, _ = _stream(tiny_model_dir, req)
    streamed, before, _ = _stream(tiny_model_dir, req, stop_after=cut)
    rest, after, reason = _stream(tiny_model_dir, continuation(req, streamed))
    assert (streamed + rest, before + after, reason) == (whole, whole_text, "length")


def test_a_stop_string_across_the_migration_point_ends_the_stream(tiny_model_dir: Path) -> None:
    """The stop-string hold-back of the first replica is streamed by the second, and a stop
    string that starts before the migration point and ends after it still stops."""
    free = GenerateRequest(request_id="free", prompt_token_ids=PROMPT, sampling=GREEDY)
    _, free_text, _ = _stream(tiny_model_dir, free)
    cut = 9
    boundary = len(_stream(tiny_model_dir, free, stop_after=cut)[1])
    stop = free_text[boundary - 2 : boundary + 2]
    assert len(stop) == 4 and free_text.find(stop) == boundary - 2, (free_text, boundary)
    sampling = GREEDY.model_copy(update={"stop": [stop]})
    req = GenerateRequest(request_id="stop", prompt_token_ids=PROMPT, sampling=sampling)
    whole, whole_text, whole_reason = _stream(tiny_model_dir, req)
    assert (whole_text, whole_reason) == (free_text[: boundary - 2], "stop")
    streamed, before, _ = _stream(tiny_model_dir, req, stop_after=cut)
    assert len(before) < boundary - 2  # the hold-back: text that could start the stop string
    rest, after, reason = _stream(tiny_model_dir, continuation(req, streamed))
    assert (streamed + rest, before + after, reason) == (whole, whole_text, "stop")
