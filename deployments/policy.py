"""Disaggregation policy: prefill a request on its decode replica or remotely.

The decode server asks ``DisaggregationPolicy.decide`` once per request. The rule follows
NVIDIA Dynamo's disaggregated router, made SLO-aware:

- short prompts (few uncached tokens, e.g. the prefix is already cached) prefill locally:
  the round trip and the KV transfer would cost more than the compute;
- long prompts prefill remotely so that they do not stall the running decode batch,
  unless the prefill pool is saturated (its predicted TTFT misses the SLO while a local
  prefill would be faster) and ``local_when_saturated`` allows it.

Whether to serve the request at all is admission's decision (``deployments/admission/``).

Remote predictions come from what this decode replica measured on its own remote calls
(``RemotePrefillEstimator``), so the policy needs no extra RPC. Pure logic: no Ray, no torch.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pdserve.deployments.config import PolicyConfig, SLOConfig

Location = Literal["local", "remote"]


@dataclass(frozen=True)
class LocalLoad:
    """The decode replica's own load, from its engine stats."""

    queued_prefill_tokens: int
    prefill_tokens_per_s: float  # measured EMA; 0 = not measured yet
    num_running: int
    max_num_seqs: int


@dataclass(frozen=True)
class Decision:
    location: Location
    reason: str
    predicted_local_s: float
    predicted_remote_s: float | None


class RemotePrefillEstimator:
    """Running estimate of a remote prefill's latency, from this replica's own calls.

    latency(tokens) = overhead_s + in_flight_tokens / pool_tokens_per_s + tokens / tokens_per_s:
    the prompts this replica already sent ahead, drained by the prefill pool, then this one,
    at one prefill replica's compute rate (the engines' measured prefill tokens/s, reported
    with each answer). The overhead (RPC, queueing behind other decode replicas' prompts,
    transfer tail) is what the observed latencies add on top. Rates and overhead are
    exponential moving averages.

    The pool's rate is the sum of the measured rates of the distinct prefill replicas that
    answered within ``pool_window_s``: the prefill router spreads this replica's prompts
    over the pool (lowest predicted TTFT first, its own in-flight books included), so the
    queue ahead drains at all of their rates at once, not at one replica's, as a planner
    (Dynamo's, DistServe's) divides the prefill queue by the number of prefill workers.
    It is the pool as this replica has seen it answer: a replica it never reached does not
    count, one that stopped answering (retired, dead) drops out after the window, and
    answers that name no replica leave the pool at one replica (the one-queue estimate).
    With one prefill replica the two estimates are the same.
    """

    def __init__(
        self,
        default_tokens_per_s: float,
        alpha: float = 0.3,
        pool_window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if default_tokens_per_s <= 0:
            raise ValueError(f"default_tokens_per_s must be > 0, got {default_tokens_per_s}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if pool_window_s <= 0:
            raise ValueError(f"pool_window_s must be > 0, got {pool_window_s}")
        self._alpha = alpha
        self._window_s = pool_window_s
        self._clock = clock
        self.tokens_per_s = default_tokens_per_s
        self.rate_measured = False  # tokens_per_s is still the configured prior
        self.overhead_s = 0.0
        self.in_flight_tokens = 0
        self.num_observed = 0
        # prefill replica -> (its measured rate, when it last answered), oldest answer first;
        # _pool_rate is the sum of those rates (kept as answers come and go, not re-summed
        # per request: a simulated day asks for it hundreds of thousands of times).
        self._pool: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._pool_rate = 0.0
        self._oldest_at = math.inf  # at most the oldest answer's time (checked lazily)

    def started(self, num_tokens: int) -> int:
        """Count a prompt as in flight; returns the tokens that were in flight before it."""
        ahead = self.in_flight_tokens
        self.in_flight_tokens += num_tokens
        return ahead

    def finished(self, num_tokens: int) -> None:
        self.in_flight_tokens = max(0, self.in_flight_tokens - num_tokens)

    def observe(
        self,
        num_tokens: int,
        total_s: float,
        tokens_per_s: float = 0.0,
        ahead_tokens: int = 0,
        replica: str = "",
    ) -> None:
        """Record one remote prefill: its end-to-end time, the prefill replica's measured
        compute rate (0 = unknown, e.g. the call failed), the tokens ``started`` said were
        ahead of it and the prefill replica that answered ("" = not named). The queue ahead
        is part of the prediction, so only what the observed time adds beyond it counts as
        overhead."""
        a = self._alpha
        if tokens_per_s > 0:
            # The first measured rate replaces the configured prior outright: the prior is a
            # guess (GPU-sized by default), and averaging it in kept predictions, deadlines
            # and shedding wrong for many requests after a cold start.
            measured = self.rate_measured
            self.tokens_per_s = (
                (1 - a) * self.tokens_per_s + a * tokens_per_s if measured else tokens_per_s
            )
            self.rate_measured = True
            if replica:
                self._answered(replica, tokens_per_s)
        expected = ahead_tokens / self.pool_tokens_per_s() + num_tokens / self.tokens_per_s
        overhead = max(0.0, total_s - expected)
        self.overhead_s = (
            overhead if self.num_observed == 0 else (1 - a) * self.overhead_s + a * overhead
        )
        self.num_observed += 1

    def _answered(self, replica: str, tokens_per_s: float) -> None:
        now = self._clock()
        previous = self._pool.pop(replica, None)
        rate = tokens_per_s
        if previous is not None:
            rate = (1 - self._alpha) * previous[0] + self._alpha * tokens_per_s
            self._pool_rate -= previous[0]
        self._pool[replica] = (rate, now)
        self._pool_rate += rate
        self._oldest_at = min(self._oldest_at, now)

    @property
    def pool_size(self) -> int:
        """Prefill replicas that answered within the window."""
        self._forget_silent()
        return len(self._pool)

    def pool_tokens_per_s(self) -> float:
        """The rate at which the prefill pool drains this replica's prompts in flight: the
        sum of the recently answering replicas' rates, or ``tokens_per_s`` (one replica)
        while no answer named its replica."""
        self._forget_silent()
        return self._pool_rate if self._pool else self.tokens_per_s

    def _forget_silent(self) -> None:
        cutoff = self._clock() - self._window_s
        if self._oldest_at >= cutoff:
            return  # nobody can have fallen silent yet (asked once or more per request)
        while self._pool:
            replica, (rate, last) = next(iter(self._pool.items()))
            if last >= cutoff:
                self._oldest_at = last
                return
            del self._pool[replica]
            self._pool_rate -= rate
        self._pool_rate = 0.0  # no drift from the running sum once the pool is empty
        self._oldest_at = math.inf

    def queue_s(self) -> float:
        """Until the pool has computed this replica's prompts in flight."""
        return self.in_flight_tokens / self.pool_tokens_per_s()

    def as_one_queue(self, queued_tokens: int) -> int:
        """Tokens queued ahead on the pool, as the tokens one replica at ``tokens_per_s``
        would take as long to compute: for the one-queue formula of admission's
        ``QueueAhead``, whose own prompt is computed at one replica's rate."""
        return round(queued_tokens * self.tokens_per_s / self.pool_tokens_per_s())

    def compute_s(self, num_tokens: int) -> float:
        """The prefill work ahead of a new prompt and its own, at the measured rates."""
        return self.queue_s() + num_tokens / self.tokens_per_s

    def predict_s(self, num_tokens: int) -> float:
        return self.overhead_s + self.compute_s(num_tokens)


class DisaggregationPolicy:
    """Decides local vs remote prefill for one request."""

    def __init__(self, config: PolicyConfig, slo: SLOConfig, default_tokens_per_s: float) -> None:
        self.config = config
        self.slo = slo
        self.default_tokens_per_s = default_tokens_per_s

    def predict_local_s(self, uncached_tokens: int, load: LocalLoad) -> float:
        rate = load.prefill_tokens_per_s or self.default_tokens_per_s
        return (load.queued_prefill_tokens + uncached_tokens) / rate

    def decide(
        self,
        *,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        load: LocalLoad,
        remote: RemotePrefillEstimator | None,
    ) -> Decision:
        """``remote`` is None when no prefill pool exists (or none is reachable)."""
        if num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        uncached = max(1, num_prompt_tokens - num_cached_tokens)
        local_s = self.predict_local_s(uncached, load)
        remote_s = remote.predict_s(num_prompt_tokens) if remote is not None else None
        slo_s = self.slo.ttft_ms / 1000.0
        mode = self.config.mode

        def decision(location: Location, reason: str) -> Decision:
            return Decision(location, reason, local_s, remote_s)

        if remote_s is None:
            return decision("local", "no_prefill_pool")
        if mode != "auto":
            return decision("local" if mode == "always_local" else "remote", "forced")
        if uncached <= self.config.local_prefill_max_tokens:
            return decision("local", "cached_prefix" if num_cached_tokens else "short_prompt")
        if self.config.local_when_saturated and remote_s > slo_s and local_s < remote_s:
            return decision("local", "prefill_pool_saturated")
        return decision("remote", "long_prompt")
