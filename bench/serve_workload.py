"""Workloads for ``pdserve.bench.serve``: length distributions, prompts with exact token counts,
and arrival schedules (Poisson or fixed concurrency). Everything is seeded, so every
endpoint compared in one run gets the very same requests in the same order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: ``fixed:N``, ``uniform:LO:HI`` or ``mix:SHORT:LONG:P``
    (SHORT tokens, but LONG tokens with probability P: a few long prompts among short ones).
    """

    kind: Literal["fixed", "uniform", "mix"]
    a: int
    b: int = 0
    p: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        parts = spec.split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2:
                dist = cls("fixed", int(parts[1]))
            elif parts[0] == "uniform" and len(parts) == 3:
                dist = cls("uniform", int(parts[1]), int(parts[2]))
            elif parts[0] == "mix" and len(parts) == 4:
                dist = cls("mix", int(parts[1]), int(parts[2]), float(parts[3]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"bad length spec {spec!r}: use fixed:N, uniform:LO:HI or mix:SHORT:LONG:P"
            ) from None
        dist.check()
        return dist

    def check(self) -> None:
        if self.a < 1 or (self.kind != "fixed" and self.b < 1):
            raise ValueError(f"{self}: lengths must be >= 1")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"{self}: HI must be >= LO")
        if self.kind == "mix" and not 0.0 <= self.p <= 1.0:
            raise ValueError(f"{self}: P must be in [0, 1]")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.randint(self.a, self.b)
        return self.b if rng.random() < self.p else self.a

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a}"
        if self.kind == "uniform":
            return f"uniform:{self.a}:{self.b}"
        return f"mix:{self.a}:{self.b}:{self.p}"


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload; ``send_at`` is seconds after the run starts (Poisson)."""

    index: int
    prompt: str
    prompt_tokens: int
    max_tokens: int
    send_at: float


class PromptBuilder:
    """Builds text prompts of an exact token count with a tokenizer.

    Prompts are sequences of random whole-word vocabulary tokens (" word": a leading space
    and letters, and the token encodes back to itself), which the tokenizer's pre-tokenizer
    splits apart again, so the text re-encodes to the same count. Tokenizers with too few
    such tokens fall back to any non-special id; a decode/encode round trip may then merge
    or split tokens, so the text is re-encoded and trimmed or extended until it has the
    requested length (or the closest length found, which ``build`` returns).
    """

    MIN_WORD_TOKENS = 100

    def __init__(self, tokenizer: Any, rng: random.Random) -> None:
        self._tok = tokenizer
        self._rng = rng
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        plain = [i for i in range(len(tokenizer)) if i not in special]
        words = [i for i in plain if self._is_word_token(i)]
        self._ids = words if len(words) >= self.MIN_WORD_TOKENS else plain

    def _is_word_token(self, token_id: int) -> bool:
        text = self._tok.decode([token_id])
        if len(text) < 2 or text[0] != " " or not text[1:].isalpha():
            return False
        return self._encode(text) == [token_id]

    def _encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def count(self, text: str) -> int:
        return len(self._encode(text))

    def build(self, num_tokens: int) -> tuple[str, int]:
        """A prompt and its token count (``num_tokens`` unless no exact text was found)."""
        ids = [self._rng.choice(self._ids) for _ in range(num_tokens)]
        text = self._tok.decode(ids)
        best: tuple[str, int] | None = None
        for _ in range(8):
            got = self._encode(text)
            if len(got) == num_tokens:
                return text, num_tokens
            if best is None or abs(len(got) - num_tokens) < abs(best[1] - num_tokens):
                best = (text, len(got))
            if len(got) > num_tokens:
                # Drop the overshoot from the end (a cut may split a character: cut more).
                text = self._tok.decode(got[: max(1, 2 * num_tokens - len(got))])
            else:
                extra = [self._rng.choice(self._ids) for _ in range(num_tokens - len(got))]
                text = self._tok.decode(got + extra)
        assert best is not None
        return best


def build_workload(
    tokenizer: Any,
    *,
    num_requests: int,
    prompt_len: LengthDist,
    output_len: LengthDist,
    rate: float | None,
    seed: int,
) -> list[BenchRequest]:
    """The requests of one run; ``rate`` (req/s) gives Poisson send times, None = all at 0
    (with fixed concurrency the runner paces them instead)."""
    rng = random.Random(seed)
    builder = PromptBuilder(tokenizer, rng)
    requests, t = [], 0.0
    for i in range(num_requests):
        text, n = builder.build(prompt_len.sample(rng))
        if rate is not None and i > 0:
            t += rng.expovariate(rate)
        requests.append(BenchRequest(i, text, n, output_len.sample(rng), t))
    return requests
