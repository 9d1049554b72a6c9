"""Request migration: a decode stream that outlives the decode replica serving it.

When the replica holding a stream dies (its actor died, or Serve has no replica for the
call), the ingress sends the request again, to another decode replica or the restarted one,
with the prompt plus the tokens already streamed as its prompt, so they are prefilled like
any prompt and generation continues where it stopped. The client's stream goes on: every
chunk is rebased so that usage counts the original prompt and all completion tokens once,
and no token is repeated or lost. A request with no token yet is simply sent again. After
``max_migrations`` the stream ends with a 503 error chunk (or, before any token, the
original error, which the ingress answers as 503).

Greedy streams continue exactly as an uninterrupted run would, and so do seeded sampled
ones: the continuation says how many of its prompt tokens were outputs
(``SamplingOptions.num_prior_output_tokens``), so the engine draws token i from the same
``(seed, i)`` and counts the same outputs for penalties and the JSON grammar. An unseeded
sampled stream continues with fresh randomness, as any sample would. This module never
touches an engine or a replica; it only re-submits.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import DeploymentUnavailableError

from pdserve.deployments.messages import ErrorInfo, GenerateChunk, GenerateRequest

MigrationCause = Literal["actor_died", "actor_unavailable", "deployment_unavailable"]
# What a dead or unreachable decode replica looks like from the ingress.
MIGRATABLE = (RayActorError, DeploymentUnavailableError)
RETRY_AFTER_S = 1.0


def migration_cause(err: BaseException) -> MigrationCause:
    if isinstance(err, DeploymentUnavailableError):
        return "deployment_unavailable"
    if isinstance(err, ActorUnavailableError):
        return "actor_unavailable"
    if isinstance(err, ActorDiedError):
        return "actor_died"
    return "actor_died"  # any other RayActorError: the actor is gone


def continuation(request: GenerateRequest, streamed: list[int]) -> GenerateRequest:
    """``request`` as sent again after ``streamed`` tokens: those join the prompt, the token
    budget (and the minimum) shrink by as many, and the sampler is told they were outputs."""
    if not streamed:
        return request.model_copy(update={"admit_by": None})
    sampling = request.sampling.model_copy(
        update={
            "max_tokens": request.sampling.max_tokens - len(streamed),
            "min_tokens": max(0, request.sampling.min_tokens - len(streamed)),
            "num_prior_output_tokens": request.sampling.num_prior_output_tokens + len(streamed),
        }
    )
    return request.model_copy(
        update={
            "prompt_token_ids": [*request.prompt_token_ids, *streamed],
            "sampling": sampling,
            "admit_by": None,  # the original admission deadline has passed
        }
    )


def rebase(chunk: GenerateChunk, num_prompt: int, num_streamed: int) -> GenerateChunk:
    """A continuation's chunk as the original request's: its prompt counts, its output
    counts include the tokens streamed before the migration."""
    if num_streamed == 0:
        return chunk
    update: dict[str, Any] = {
        "num_prompt_tokens": num_prompt,
        "num_cached_tokens": min(chunk.num_cached_tokens, num_prompt),
    }
    if chunk.num_output_tokens:
        update["num_output_tokens"] = chunk.num_output_tokens + num_streamed
    return chunk.model_copy(update=update)


def _can_continue(request: GenerateRequest, num_streamed: int) -> bool:
    return num_streamed < request.sampling.max_tokens


class MigratingStream:
    """Stands where the ingress held a streaming decode response (``async for`` and
    ``cancel()``); behind it, one decode call after another until the request finishes.

    ``submit`` sends a request to the decode pool and returns Serve's streaming response;
    ``on_migrate`` is told each migration's cause (for the metric).
    """

    def __init__(
        self,
        submit: Callable[[GenerateRequest], Any],
        request: GenerateRequest,
        *,
        max_migrations: int,
        on_migrate: Callable[[MigrationCause], None] = lambda _cause: None,
    ) -> None:
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {max_migrations}")
        self._submit = submit
        self._request = request
        self._max_migrations = max_migrations
        self._on_migrate = on_migrate
        self._current = submit(request)
        self.migrations = 0

    def cancel(self) -> None:
        self._current.cancel()

    def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[GenerateChunk]:
        num_prompt = len(self._request.prompt_token_ids)
        streamed: list[int] = []
        before = 0  # tokens streamed before the current call was sent
        while True:
            try:
                async for chunk in self._current:
                    chunk = rebase(chunk, num_prompt, before)
                    streamed.extend(chunk.token_ids)
                    yield chunk
                return
            except MIGRATABLE as err:
                cause = migration_cause(err)
                if self.migrations >= self._max_migrations or not _can_continue(
                    self._request, len(streamed)
                ):
                    if not streamed:
                        raise  # nothing sent yet: the ingress answers 503
                    yield self._failed(cause, len(streamed))
                    return
                self.migrations += 1
                self._on_migrate(cause)
                before = len(streamed)
                self._current = self._submit(continuation(self._request, streamed))

    def _failed(self, cause: MigrationCause, num_streamed: int) -> GenerateChunk:
        message = (
            f"the decode replica serving this stream failed ({cause}) after "
            f"{num_streamed} tokens and the stream could not be moved "
            f"({self.migrations} of {self._max_migrations} migrations used)"
        )
        return GenerateChunk(
            request_id=self._request.request_id,
            num_prompt_tokens=len(self._request.prompt_token_ids),
            num_output_tokens=num_streamed,
            error=ErrorInfo(
                code=503, type="service_unavailable", message=message, retry_after_s=RETRY_AFTER_S
            ),
        )


class MigrationMetrics:
    """``pdserve_request_migrations{model_name, role, replica, cause}``: streams moved to
    another decode replica, by why their replica went away."""

    def __init__(self, *, model_name: str, replica: str, enabled: bool) -> None:
        self._counter = None
        if enabled:
            from ray.util.metrics import Counter

            self._counter = Counter(
                "pdserve_request_migrations",
                "Streams re-submitted to another decode replica after theirs failed.",
                tag_keys=("model_name", "role", "replica", "cause"),
            )
            self._counter.set_default_tags(
                {"model_name": model_name, "role": "ingress", "replica": replica}
            )

    def record(self, cause: MigrationCause) -> None:
        if self._counter is not None:
            self._counter.inc(1.0, {"cause": cause})
