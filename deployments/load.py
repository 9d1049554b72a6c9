"""Load signals a replica publishes: routing stats, autoscaling stats, and the meters behind
them (arrival rate over a sliding window, exponential moving averages).

Pure bookkeeping, no Ray: the servers call these from ``record_routing_stats`` and
``record_autoscaling_stats``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pdserve.deployments import autoscaling
from pdserve.deployments.config import PoolRole
from pdserve.deployments.kv_events import KVEventBatch
from pdserve.deployments.messages import ReplicaStats
from pdserve.engine.stats import EngineStats


class RateMeter:
    """Events per second over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, float]] = deque()
        self._total = 0.0

    def add(self, amount: float) -> None:
        now = self._clock()
        self._events.append((now, amount))
        self._total += amount
        self._trim(now)

    def rate(self) -> float:
        self._trim(self._clock())
        return self._total / self.window_s

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._total -= self._events.popleft()[1]


class Ema:
    """Exponential moving average; 0.0 until the first sample."""

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value = 0.0
        self._seen = False

    def add(self, sample: float) -> None:
        self.value = (
            sample if not self._seen else self.alpha * sample + (1 - self.alpha) * self.value
        )
        self._seen = True


def replica_stats(
    role: PoolRole,
    stats: EngineStats,
    *,
    max_num_seqs: int,
    kv_bytes_per_token: int,
    prompt_tokens_per_s: float,
    kv_events: list[KVEventBatch] | None = None,
    window_kv_bytes_per_token: int = 0,
    kv_window: int = 0,
) -> ReplicaStats:
    return ReplicaStats(
        role=role,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_waiting_remote_kv=stats.num_waiting_remote_kv,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        prefill_tokens_per_s=stats.prefill_tokens_per_s,
        decode_tokens_per_s=stats.decode_tokens_per_s,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        kv_usage=stats.kv_usage,
        max_num_seqs=max_num_seqs,
        block_size=stats.block_size,
        kv_bytes_per_token=kv_bytes_per_token,
        window_kv_bytes_per_token=window_kv_bytes_per_token,
        kv_window=kv_window,
        prompt_tokens_per_s=prompt_tokens_per_s,
        kv_events=kv_events or [],
    )


def prefill_autoscaling_stats(stats: EngineStats, prompt_tokens_per_s: float) -> dict[str, float]:
    return {
        autoscaling.PROMPT_TOKENS_PER_S: prompt_tokens_per_s,
        autoscaling.PREFILL_TOKENS_PER_S: stats.prefill_tokens_per_s,
        autoscaling.QUEUED_PREFILL_TOKENS: float(stats.queued_prefill_tokens),
    }


def decode_autoscaling_stats(
    stats: EngineStats,
    tpot_s: float,
    prompt_tokens_per_s: float = 0.0,
    kv_refused_per_s: float = 0.0,
) -> dict[str, float]:
    """KV usage and TPOT size the pool; the batch count keeps a scale-down from stranding
    requests; the prompt tokens admitted here (and the local prefill rate and queue) size
    the prefill work, on this pool when it prefills locally; remote prefills refused for
    lack of KV room (each then prefilled here) call for another replica."""
    return {
        autoscaling.KV_REFUSED_PER_S: kv_refused_per_s,
        autoscaling.KV_USAGE: stats.kv_usage,
        autoscaling.TPOT_S: tpot_s,
        autoscaling.NUM_WAITING: float(stats.num_waiting),
        autoscaling.NUM_IN_BATCH: float(
            stats.num_running + stats.num_waiting + stats.num_waiting_remote_kv
        ),
        autoscaling.PROMPT_TOKENS_PER_S: prompt_tokens_per_s,
        autoscaling.PREFILL_TOKENS_PER_S: stats.prefill_tokens_per_s,
        autoscaling.QUEUED_PREFILL_TOKENS: float(stats.queued_prefill_tokens),
    }


class LoopLag:
    """How late an asyncio event loop runs its callbacks (an EMA of the overshoot of a
    periodic sleep): the queue of work inside a process, which no request count shows.
    The ingress sheds on it, since every request and every streamed chunk waits for it."""

    def __init__(self, period_s: float = 0.05, alpha: float = 0.3) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.period_s = period_s
        self.ema = Ema(alpha)
        self._task: Any = None

    def ensure_running(self) -> None:
        """Start measuring on the running loop (idempotent)."""
        import asyncio

        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._measure())

    @property
    def seconds(self) -> float:
        return self.ema.value

    async def _measure(self) -> None:
        import asyncio

        while True:
            began = time.monotonic()
            await asyncio.sleep(self.period_s)
            self.ema.add(max(0.0, time.monotonic() - began - self.period_s))
