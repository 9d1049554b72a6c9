"""Per-request sampling parameters, validated on construction.

Bad values raise ``ValueError`` naming the field, so the HTTP layer can turn them into a 400
with ``param`` set. This module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # OpenAI's range for presence/frequency penalties: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``stop`` accepts a single string or a list of strings (normalised to a list).
    ``top_k=0`` disables top-k; ``temperature=0`` means greedy. Penalties follow OpenAI
    (presence/frequency over the generated tokens) and vLLM/transformers (repetition over
    prompt and output); ``logit_bias`` (token id -> bias, a mapping or pairs) is stored as
    sorted pairs so the params stay hashable; ``min_p`` drops tokens whose probability is
    below ``min_p`` times the most likely one's.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Any = ()  # tuple[tuple[int, float], ...] after validation
    min_p: float = 0.0
    # Structured output (engine/grammar.py): any JSON value, or JSON matching a schema.
    json_object: bool = False
    json_schema: str | None = None  # the schema, serialised as JSON
    # Output tokens this request produced elsewhere before it was continued here (a migrated
    # stream): they are the last tokens of its prompt, and seeded draws, the penalties and
    # the grammar count them as output, so the continuation samples as the original would.
    num_prior_output_tokens: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not _is_number(self.temperature) or not self.temperature >= 0.0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(
                f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}"
            )
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise ValueError(f"json_schema must be a JSON string, got {self.json_schema!r}")
        if not _is_int(self.num_prior_output_tokens) or self.num_prior_output_tokens < 0:
            raise ValueError(
                "num_prior_output_tokens must be an integer >= 0, "
                f"got {self.num_prior_output_tokens!r}"
            )

    @property
    def structured(self) -> bool:
        """Whether a grammar constrains this request's output."""
        return self.json_object or self.json_schema is not None

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens (the penalties do, and a
        grammar catches up on tokens sampled elsewhere)."""
        return (
            bool(self.presence_penalty or self.frequency_penalty)
            or self.repetition_penalty != 1.0
            or self.structured
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether any penalty, bias or min_p changes this request's logits."""
        return self.needs_history or bool(self.logit_bias) or self.min_p > 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _normalise_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only strings, got {s!r}")
        if not s:
            raise ValueError("stop must not contain empty strings")
    return list(stop)


def _normalise_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    items = bias.items() if isinstance(bias, dict) else bias
    if not isinstance(items, (list, tuple)) and not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    pairs: dict[int, float] = {}
    for entry in items:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias), got {entry!r}")
        token, value = entry
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r}")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


def _normalise_stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers, got {type(ids).__name__}")
    for t in ids:
        if not _is_int(t) or t < 0:
            raise ValueError(f"stop_token_ids must contain integers >= 0, got {t!r}")
    return list(ids)
