"""What the engine returns to its caller after each step (plain frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one sampled token and, if requested, the top-n alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(frozen=True)
class RequestOutput:
    """A request's progress after one step; ``*_delta``/``new_*`` fields hold only what is new.

    ``text`` never contains a stop string, and every ``text_delta`` ever emitted is a prefix
    slice of the final ``text`` (text that could still turn into a stop string is held back
    until it is decided).
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    token_ids: list[int]
    text_delta: str
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: FinishReason | None
    num_cached_tokens: int
    arrival_time: float
    first_token_time: float | None = None
    num_preemptions: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output carrying the deltas of two consecutive outputs of the same request.

    A consumer that falls behind the engine (a busy event loop, a slow client) gets what
    accumulated in one piece instead of one message per token, as vLLM's output collector
    does; the concatenated deltas are exactly what the two would have delivered.
    """
    if earlier.request_id != later.request_id:
        raise ValueError(
            f"request_id: cannot merge outputs of {earlier.request_id!r} and {later.request_id!r}"
        )
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = [*(earlier.logprobs or []), *(later.logprobs or [])]
    return replace(
        later,
        new_token_ids=[*earlier.new_token_ids, *later.new_token_ids],
        text_delta=earlier.text_delta + later.text_delta,
        logprobs=logprobs,
        first_token_time=earlier.first_token_time or later.first_token_time,
    )
