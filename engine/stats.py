"""Engine load statistics: a frozen snapshot for routers/autoscalers, and throughput meters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """What an engine reports about its load after a step. Rates are 0.0 until measured."""

    num_running: int
    num_waiting: int
    num_waiting_remote_kv: int
    num_sending_kv: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    queued_prefill_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    kv_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_prompt_tokens: int
    num_generation_tokens: int
    # The window layers' own pool (engine/window_kv.py, null block excluded); 0: none.
    num_window_free_blocks: int = 0
    num_window_total_blocks: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class ThroughputMeter:
    """Exponential moving average of tokens per second over the steps that did such work.

    The first step of a fresh engine pays one-time costs (the weights paged in, the CPU
    kernels' first calls), so it can be several times slower than the next ones
    (docs/tuning.md). It stands as the rate until the next step, which replaces it instead
    of being averaged with it."""

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.rate = 0.0
        self._samples = 0

    def update(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0.0:
            return
        sample = num_tokens / seconds
        if self._samples < 2:
            self.rate = sample
        else:
            self.rate = self.alpha * sample + (1 - self.alpha) * self.rate
        self._samples += 1
