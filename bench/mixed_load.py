"""Mixed OpenAI traffic for the reliability benches (``bench.chaos``, ``bench.soak``).

``RequestSpec`` says what one request asks for (completion or chat, prompt length, output
length, greedy or seeded sampling, ``n``, JSON mode, whether the client walks away
mid-stream); ``stream_request`` sends it as a streaming request and records what the client
saw in an ``Outcome``. Everything is seeded; nothing here knows about Ray or the cluster.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=300.0)
WORDS = [
    "river",
    "mill",
    "stone",
    "bridge",
    "lantern",
    "harbor",
    "meadow",
    "orchard",
    "valley",
    "signal",
    "copper",
    "winter",
    "garden",
    "market",
    "engine",
    "ladder",
    "thunder",
    "pepper",
    "candle",
    "silver",
    "forest",
    "window",
    "morning",
]


@dataclass(frozen=True)
class RequestSpec:
    """One request of the load."""

    kind: Literal["completion", "chat"]
    prompt: str
    max_tokens: int
    seed: int | None = None  # None: greedy; else temperature 0.8 with this seed
    n: int = 1
    json_mode: bool = False  # chat with response_format json_object
    disconnect_after: int | None = None  # close the connection after this many content deltas

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.json_mode and self.kind != "chat":
            raise ValueError(f"json_mode needs kind 'chat', got {self.kind!r}")

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": self.n,
            # JSON mode ends when the object closes; everything else runs its full length,
            # so a stream that stops short is visible in its usage.
            "ignore_eos": not self.json_mode,
            "temperature": 0.0 if self.seed is None else 0.8,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.kind == "completion":
            body["prompt"] = self.prompt
        else:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        if self.json_mode:
            body["response_format"] = {"type": "json_object"}
        return body

    @property
    def path(self) -> str:
        return "/v1/completions" if self.kind == "completion" else "/v1/chat/completions"


@dataclass(frozen=True)
class LoadMix:
    """How the load is mixed: prompt words and output tokens drawn uniformly from their
    ranges, and the fractions of seeded, ``n`` > 1, JSON-mode and disconnecting requests."""

    prompt_words: tuple[int, int] = (4, 300)
    max_tokens: tuple[int, int] = (8, 128)
    seeded: float = 0.3
    multi_n: float = 0.0
    json_mode: float = 0.0
    disconnect: float = 0.0

    def __post_init__(self) -> None:
        for name in ("seeded", "multi_n", "json_mode", "disconnect"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a fraction in [0, 1], got {value}")
        for name in ("prompt_words", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")

    def sample(self, rng: random.Random) -> RequestSpec:
        words = rng.randint(*self.prompt_words)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        max_tokens = rng.randint(*self.max_tokens)
        json_mode = rng.random() < self.json_mode
        kind: Literal["completion", "chat"] = (
            "chat" if json_mode or rng.random() < 0.5 else "completion"
        )
        if json_mode:
            prompt = "Answer with a JSON object about: " + prompt
        disconnect = None
        if rng.random() < self.disconnect:
            disconnect = rng.randint(1, max(1, max_tokens // 2))
        return RequestSpec(
            kind=kind,
            prompt=prompt,
            max_tokens=max_tokens,
            seed=rng.randrange(1 << 30) if rng.random() < self.seeded else None,
            n=2 if rng.random() < self.multi_n else 1,
            json_mode=json_mode,
            disconnect_after=disconnect,
        )


@dataclass
class Outcome:
    """One request as the client saw it (times in seconds since the run began)."""

    spec: RequestSpec
    sent: float
    status: int | None = None
    ttft: float | None = None  # first content delta
    ended: float | None = None
    deltas: int = 0  # content deltas received (all choices)
    finished: bool = False  # [DONE] after every choice had its finish_reason
    completion_tokens: int | None = None  # from the usage chunk
    error: str | None = None
    error_type: str | None = None  # OpenAI error type of an error status or chunk
    disconnected: bool = False  # the client closed the stream on purpose
    texts: dict[int, str] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        """Not answered in full (a disconnect on purpose is not a failure)."""
        if self.disconnected:
            return False
        return not (self.status == 200 and self.finished and self.error is None)

    @property
    def after_first_token(self) -> bool:
        return self.ttft is not None

    @property
    def server_error(self) -> bool:
        """A 5xx status, an error chunk that is not a rate limit, or no answer at all."""
        if self.disconnected:
            return False
        if self.status is not None and self.status >= 500:
            return True
        if self.status == 200 and self.error is not None:
            return self.error_type not in ("rate_limit_error", "overloaded")
        return self.status is None

    @property
    def short(self) -> bool:
        """Finished, but fewer tokens than asked for a request that ignores EOS."""
        if not self.finished or self.spec.json_mode or self.completion_tokens is None:
            return False
        return self.completion_tokens != self.spec.max_tokens * self.spec.n


async def stream_request(
    client: aiohttp.ClientSession, base_url: str, model: str, out: Outcome, began: float
) -> None:
    """Send ``out.spec`` and read its SSE stream into ``out``."""
    spec = out.spec
    start = time.perf_counter()
    try:
        async with client.post(
            base_url + spec.path, json=spec.body(model), timeout=REQUEST_TIMEOUT
        ) as resp:
            out.status = resp.status
            if resp.status != 200:
                raw = await resp.read()
                out.error, out.error_type = _error_of(raw)
                return
            finished: set[int] = set()
            async for raw_line in resp.content:
                line = raw_line.decode()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.finished = len(finished) == spec.n and out.error is None
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    out.error, out.error_type = _error_of(data.encode())
                    break
                if obj.get("usage"):
                    out.completion_tokens = obj["usage"].get("completion_tokens")
                for choice in obj.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if text:
                        index = int(choice.get("index", 0))
                        out.texts[index] = out.texts.get(index, "") + text
                        out.deltas += 1
                        if out.ttft is None:
                            out.ttft = time.perf_counter() - start
                    if choice.get("finish_reason"):
                        finished.add(int(choice.get("index", 0)))
                if spec.disconnect_after is not None and out.deltas >= spec.disconnect_after:
                    out.disconnected = True
                    resp.close()  # drop the connection mid-stream, as a client that left
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        out.error = f"{type(err).__name__}: {err}"[:200]
    finally:
        out.ended = time.perf_counter() - began


def _error_of(raw: bytes) -> tuple[str, str | None]:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("message"))[:200], err.get("type")
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:200], None


def pct(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (nearest rank) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def int_range(spec: str, name: str) -> tuple[int, int]:
    """A command line's ``LO:HI`` option as two ints."""
    try:
        lo, hi = (int(v) for v in spec.split(":"))
    except ValueError:
        raise SystemExit(f"{name} must be LO:HI, got {spec!r}") from None
    return lo, hi
