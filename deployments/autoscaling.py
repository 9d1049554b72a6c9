"""Custom Serve autoscaling policies: prefill sized by prompt-token arrival vs the TTFT SLO,
decode sized by KV usage vs the TPOT SLO.

Ray 2.60 calls ``autoscaling_config.policy.policy_function`` with an ``AutoscalingContext``;
a class given there is instantiated once with ``policy.policy_kwargs`` and then called per
tick. Serve itself applies the up/downscale delays, scaling factors and min/max bounds
around what these policies return. The signals come from the replicas'
``record_autoscaling_stats()`` (names in ``PREFILL_METRICS`` / ``DECODE_METRICS``),
averaged by Serve over ``look_back_period_s``.

The sizing math is in pure functions (``prefill_replicas_needed``, ``decode_replicas_needed``)
unit-tested without Ray. This module must stay importable inside the Serve controller:
it imports only the standard library at module level.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Names of the custom metrics each replica reports (record_autoscaling_stats keys).
PROMPT_TOKENS_PER_S = "prompt_tokens_per_s"  # prompt tokens arriving per second
PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"  # measured prefill throughput (capacity)
QUEUED_PREFILL_TOKENS = "queued_prefill_tokens"
KV_USAGE = "kv_usage"  # fraction of KV blocks in use, 0..1
TPOT_S = "tpot_s"  # measured time per output token of the running batch
NUM_WAITING = "num_waiting"
PREFILL_METRICS = (PROMPT_TOKENS_PER_S, PREFILL_TOKENS_PER_S, QUEUED_PREFILL_TOKENS)
DECODE_METRICS = (KV_USAGE, TPOT_S, NUM_WAITING)


@dataclass(frozen=True)
class PrefillSizing:
    ttft_s: float
    default_tokens_per_s: float
    target_utilization: float = 0.7


@dataclass(frozen=True)
class DecodeSizing:
    tpot_s: float
    target_kv_usage: float = 0.75
    target_tpot_fraction: float = 0.8


def prefill_replicas_needed(
    current: int,
    arrival_tokens_per_s: Sequence[float],
    capacity_tokens_per_s: Sequence[float],
    queued_tokens: Sequence[float],
    s: PrefillSizing,
) -> int:
    """Replicas so that arrivals use at most ``target_utilization`` of the pool's prefill
    capacity, and the current backlog drains within the TTFT SLO."""
    measured = [c for c in capacity_tokens_per_s if c > 0]
    per_replica = sum(measured) / len(measured) if measured else s.default_tokens_per_s
    arrival = sum(arrival_tokens_per_s)
    by_rate = arrival / (per_replica * s.target_utilization)
    by_backlog = sum(queued_tokens) / (per_replica * s.ttft_s)
    needed = math.ceil(max(by_rate, by_backlog) - 1e-9)
    if needed == 0 and current > 0 and arrival > 0:
        needed = 1
    return needed


def decode_replicas_needed(
    current: int,
    kv_usage: Sequence[float],
    tpot_s: Sequence[float],
    num_waiting: Sequence[float],
    s: DecodeSizing,
) -> int:
    """Replicas so that mean KV usage stays under ``target_kv_usage`` and the measured TPOT
    under ``target_tpot_fraction`` x SLO; requests waiting for KV add one replica."""
    if current <= 0:
        return 1
    kv = sum(kv_usage) / len(kv_usage) if kv_usage else 0.0
    tpot = sum(tpot_s) / len(tpot_s) if tpot_s else 0.0
    by_kv = current * kv / s.target_kv_usage
    by_tpot = current * tpot / (s.tpot_s * s.target_tpot_fraction)
    needed = math.ceil(max(by_kv, by_tpot) - 1e-9)
    if sum(num_waiting) > 0 and kv >= s.target_kv_usage:
        needed = max(needed, current + 1)
    return max(needed, 1)


def _values(ctx: Any, name: str) -> list[float]:
    metrics: Mapping[str, Mapping[Any, float]] | None = ctx.aggregated_metrics
    if not metrics or name not in metrics:
        return []
    return [float(v) for v in metrics[name].values()]


class PrefillAutoscalingPolicy:
    """``policy_function`` for the prefill deployment (kwargs: ttft_ms, default_tokens_per_s,
    target_utilization)."""

    def __init__(
        self, ttft_ms: float, default_tokens_per_s: float, target_utilization: float = 0.7
    ) -> None:
        self.sizing = PrefillSizing(ttft_ms / 1000.0, default_tokens_per_s, target_utilization)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        arrival = _values(ctx, PROMPT_TOKENS_PER_S)
        if not arrival:  # no reports yet: hold steady
            return ctx.target_num_replicas, ctx.policy_state
        needed = prefill_replicas_needed(
            ctx.current_num_replicas,
            arrival,
            _values(ctx, PREFILL_TOKENS_PER_S),
            _values(ctx, QUEUED_PREFILL_TOKENS),
            self.sizing,
        )
        return needed, ctx.policy_state


class DecodeAutoscalingPolicy:
    """``policy_function`` for the decode deployment (kwargs: tpot_ms, target_kv_usage)."""

    def __init__(self, tpot_ms: float, target_kv_usage: float = 0.75) -> None:
        self.sizing = DecodeSizing(tpot_ms / 1000.0, target_kv_usage)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        kv = _values(ctx, KV_USAGE)
        if not kv:
            return ctx.target_num_replicas, ctx.policy_state
        needed = decode_replicas_needed(
            ctx.current_num_replicas,
            kv,
            _values(ctx, TPOT_S),
            _values(ctx, NUM_WAITING),
            self.sizing,
        )
        return needed, ctx.policy_state


POLICY_PATHS = {
    "prefill": f"{__name__}:PrefillAutoscalingPolicy",
    "decode": f"{__name__}:DecodeAutoscalingPolicy",
}
