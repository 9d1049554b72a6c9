"""Request migration without a cluster: a fake decode pool whose replicas die after a given
number of tokens, each one generating a fixed "model" continuation from whatever prompt it
is sent. The client's stream must equal an uninterrupted run's, with usage counted once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import DeploymentUnavailableError

from pdserve.deployments.messages import GenerateChunk, GenerateRequest, SamplingOptions
from pdserve.deployments.migration import MigratingStream, continuation


def model_next(tokens: list[int]) -> int:
    """A deterministic "model": the next token depends on the whole sequence so far."""
    return (sum(tokens) * 31 + len(tokens)) % 1000


class FakeDecodePool:
    """Each call is served by a new replica that dies (``ActorDiedError``) after the number of
    tokens the next entry of ``deaths`` says (None = lives); records every request sent."""

    def __init__(
        self, deaths: list[int | None], error: type[Exception] = ActorDiedError, *args: object
    ) -> None:
        self.deaths = list(deaths)
        self.error, self.error_args = error, args
        self.sent: list[GenerateRequest] = []
        self.cancelled = 0

    def submit(self, request: GenerateRequest) -> FakeResponse:
        self.sent.append(request)
        dies_after = self.deaths.pop(0) if self.deaths else None
        return FakeResponse(self, request, dies_after)


class FakeResponse:
    def __init__(self, pool: FakeDecodePool, request: GenerateRequest, dies_after: int | None):
        self.pool, self.request, self.dies_after = pool, request, dies_after

    def cancel(self) -> None:
        self.pool.cancelled += 1

    def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[GenerateChunk]:
        req = self.request
        seq = list(req.prompt_token_ids)
        for i in range(req.sampling.max_tokens):
            if self.dies_after is not None and i == self.dies_after:
                raise self.pool.error(*self.pool.error_args)
            seq.append(model_next(seq))
            last = i + 1 == req.sampling.max_tokens
            yield GenerateChunk(
                request_id=req.request_id,
                token_ids=[seq[-1]],
                num_prompt_tokens=len(req.prompt_token_ids),
                num_output_tokens=i + 1,
                finish_reason="length" if last else None,
            )
            await asyncio.sleep(0)


def request(max_tokens: int = 12, **sampling: object) -> GenerateRequest:
    options = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    options = options.model_copy(update=sampling)
    return GenerateRequest(request_id="r1", prompt_token_ids=[5, 7, 11], sampling=options)


def run(pool: FakeDecodePool, req: GenerateRequest, max_migrations: int = 2):
    causes: list[str] = []
    stream = MigratingStream(
        pool.submit, req, max_migrations=max_migrations, on_migrate=causes.append
    )

    async def collect() -> list[GenerateChunk]:
        return [c async for c in stream]

    return asyncio.run(collect()), causes, stream


def uninterrupted(req: GenerateRequest) -> list[int]:
    chunks, _, _ = run(FakeDecodePool([None]), req)
    return [t for c in chunks for t in c.token_ids]


def test_a_stream_whose_replica_dies_twice_equals_an_uninterrupted_run() -> None:
    req = request()
    pool = FakeDecodePool([4, 3, None])
    chunks, causes, stream = run(pool, req)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == uninterrupted(req) and len(tokens) == 12
    assert causes == ["actor_died", "actor_died"] and stream.migrations == 2
    # The continuations carried the streamed tokens as prompt and the rest of the budget.
    assert [len(r.prompt_token_ids) for r in pool.sent] == [3, 7, 10]
    assert [r.sampling.max_tokens for r in pool.sent] == [12, 8, 5]
    # Usage as the client sees it: the original prompt, every completion token once.
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert (last.num_prompt_tokens, last.num_output_tokens) == (3, 12)
    assert all(c.num_prompt_tokens == 3 for c in chunks)
    assert [c.num_output_tokens for c in chunks] == list(range(1, 13))


def test_a_request_with_no_token_yet_is_sent_again_unchanged() -> None:
    req = request(max_tokens=5)
    pool = FakeDecodePool([0, None], DeploymentUnavailableError, "decode")
    chunks, causes, _ = run(pool, req)
    assert [t for c in chunks for t in c.token_ids] == uninterrupted(req)
    assert causes == ["deployment_unavailable"]
    assert pool.sent[1].prompt_token_ids == req.prompt_token_ids


def test_past_the_bound_the_stream_ends_with_a_503_chunk() -> None:
    req = request()
    chunks, causes, _ = run(FakeDecodePool([2, 2, 2]), req, max_migrations=1)
    assert causes == ["actor_died"]
    *tokens, last = chunks
    assert [t for c in tokens for t in c.token_ids] == uninterrupted(req)[:4]
    assert last.error is not None and last.error.code == 503
    assert last.num_output_tokens == 4


def test_before_any_token_past_the_bound_the_error_is_raised() -> None:
    with pytest.raises(ActorDiedError):
        run(FakeDecodePool([0]), request(), max_migrations=0)


def test_a_seeded_sampled_stream_migrates_and_says_how_many_tokens_came_before() -> None:
    req = request(temperature=0.8, seed=1234)
    pool = FakeDecodePool([3, 4, None])
    chunks, causes, _ = run(pool, req)
    assert causes == ["actor_died", "actor_died"]
    assert chunks[-1].error is None and chunks[-1].finish_reason == "length"
    assert [t for c in chunks for t in c.token_ids] == uninterrupted(req)
    # Each continuation tells the engine how many of its prompt tokens were outputs, so
    # the seeded draws go on from (seed, 3) and (seed, 7) (tests/deployments/
    # test_migration_engine.py runs that on a real engine).
    assert [r.sampling.num_prior_output_tokens for r in pool.sent] == [0, 3, 7]
    assert all(r.sampling.seed == 1234 for r in pool.sent)


def test_continuation_keeps_the_minimum_and_drops_the_admission_deadline() -> None:
    req = request(max_tokens=10, min_tokens=6).model_copy(update={"admit_by": 123.0})
    nxt = continuation(req, [1, 2, 3, 4])
    assert nxt.prompt_token_ids == [5, 7, 11, 1, 2, 3, 4]
    assert (nxt.sampling.max_tokens, nxt.sampling.min_tokens, nxt.admit_by) == (6, 2, None)
    assert nxt.sampling.num_prior_output_tokens == 4
    assert nxt.request_id == req.request_id


def test_cancel_reaches_the_current_call() -> None:
    pool = FakeDecodePool([None])
    MigratingStream(pool.submit, request(), max_migrations=1).cancel()
    assert pool.cancelled == 1
    with pytest.raises(ValueError, match="-1"):
        MigratingStream(pool.submit, request(), max_migrations=-1)
