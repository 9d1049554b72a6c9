"""The HTTP API's edge checks: API keys, body size and per-key rate limits.

``APIGuard`` answers, for one request's path and headers, either who the caller is (the key,
or the client address when no keys are configured) or the ``OpenAIError`` to send (401,
429 with Retry-After). It reads no environment variable and imports neither Ray nor torch:
keys arrive in ``APIConfig``, already merged from the CLI flag and env by the caller.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import AsyncIterable, Callable, Mapping
from dataclasses import dataclass, field

from pdserve.deployments.config import APIConfig
from pdserve.deployments.openai_protocol import OpenAIError

HEALTH_PATHS = frozenset({"/health", "/ready", "/version"})
METRICS_PATH = "/metrics"
# Buckets idle this long are dropped, so that one-off client addresses do not pile up.
IDLE_BUCKET_S = 600.0


@dataclass
class TokenBucket:
    """``capacity`` requests at once, refilled at ``rate_per_s``."""

    capacity: float
    rate_per_s: float
    tokens: float
    updated: float

    def take(self, now: float) -> float:
        """Take one request; 0.0 if allowed, else the seconds until one is available."""
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


@dataclass
class APIGuard:
    """Authentication and rate limiting of one ingress replica."""

    config: APIConfig
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, TokenBucket] = field(default_factory=dict)
    _digests: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Compare fixed-length digests: compare_digest is constant-time only for equal lengths.
        self._digests = [_digest(key) for key in self.config.api_keys]

    @property
    def keyed(self) -> bool:
        """Whether it checks API keys."""
        return bool(self._digests)

    def caller(self, path: str, headers: Mapping[str, str], client: str | None) -> str | None:
        """The caller's identity for rate limiting (None on an open route).

        Raises ``OpenAIError`` 401 for a missing or wrong key and 429 past the rate limit.
        """
        if self._open(path):
            return None
        identity = self._authenticate(headers) if self._digests else f"addr:{client or '?'}"
        self._limit(identity)
        return identity

    def _open(self, path: str) -> bool:
        if path in HEALTH_PATHS:
            return self.config.open_health or not self._digests
        if path == METRICS_PATH:
            return self.config.open_metrics or not self._digests
        return False

    def _authenticate(self, headers: Mapping[str, str]) -> str:
        key = _presented_key(headers)
        if key is None:
            raise _unauthorized(
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
            )
        digest = _digest(key)
        # Check every key (no early exit) so timing says nothing about which one matched.
        matched = -1
        for i, known in enumerate(self._digests):
            if hmac.compare_digest(digest, known):
                matched = i
        if matched < 0:
            raise _unauthorized("Incorrect API key provided.")
        return f"key:{matched}"

    def _limit(self, identity: str) -> None:
        rpm = self.config.rate_limit_per_minute
        if rpm is None:
            return
        now = self.clock()
        bucket = self._buckets.get(identity)
        if bucket is None:
            self._forget_idle(now)
            burst = float(self.config.rate_limit_burst)
            bucket = self._buckets[identity] = TokenBucket(burst, rpm / 60.0, burst, now)
        wait_s = bucket.take(now)
        if wait_s > 0:
            raise OpenAIError(
                f"Rate limit reached: {rpm:g} requests per minute. Retry after {wait_s:.1f}s.",
                status_code=429,
                type="rate_limit_exceeded",
                code="rate_limit_exceeded",
                retry_after_s=wait_s,
            )

    def _forget_idle(self, now: float) -> None:
        stale = [k for k, b in self._buckets.items() if now - b.updated > IDLE_BUCKET_S]
        for key in stale:
            del self._buckets[key]


async def read_body(chunks: AsyncIterable[bytes], declared: str | None, limit: int) -> bytes:
    """The whole request body, or a 413 as soon as it is known to exceed ``limit`` bytes
    (from Content-Length before reading anything, else while reading)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        f"The request body is larger than the limit of {limit} bytes.",
        status_code=413,
        code="request_too_large",
    )


def _presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return headers.get("x-api-key") or None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(
        message, status_code=401, type="invalid_request_error", code="invalid_api_key"
    )
