"""Autoscaling math: prefill from prompt-token arrival vs TTFT, decode from KV usage vs TPOT."""

from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from pdserve.deployments.autoscaling import (
    DecodeAutoscalingPolicy,
    DecodeSizing,
    PrefillAutoscalingPolicy,
    PrefillSizing,
    decode_replicas_needed,
    prefill_replicas_needed,
)

PREFILL = PrefillSizing(ttft_s=1.0, default_tokens_per_s=1000.0, target_utilization=0.5)
DECODE = DecodeSizing(tpot_s=0.1, target_kv_usage=0.5, target_tpot_fraction=1.0)


def test_prefill_scales_with_arrival_rate_over_capacity() -> None:
    # 3000 tok/s arriving, 1000 tok/s per replica at 50% target utilisation -> 6 replicas.
    assert prefill_replicas_needed(2, [1500.0, 1500.0], [1000.0, 1000.0], [0, 0], PREFILL) == 6
    # Measured capacity beats the default: 2000 tok/s per replica -> 3.
    assert prefill_replicas_needed(2, [1500.0, 1500.0], [2000.0, 0.0], [0, 0], PREFILL) == 3


def test_prefill_backlog_must_drain_within_ttft() -> None:
    # Low arrival but 4000 queued tokens at 1000 tok/s with a 1 s TTFT -> 4 replicas.
    assert prefill_replicas_needed(1, [10.0], [1000.0], [4000.0], PREFILL) == 4


def test_idle_prefill_pool_scales_down() -> None:
    assert prefill_replicas_needed(3, [0.0, 0.0, 0.0], [1000.0] * 3, [0.0] * 3, PREFILL) == 0
    assert prefill_replicas_needed(3, [1.0, 0.0, 0.0], [1000.0] * 3, [0.0] * 3, PREFILL) == 1


def test_decode_scales_with_kv_usage_and_tpot() -> None:
    # Mean KV usage 0.75 against a 0.5 target: 2 -> 3 replicas.
    assert decode_replicas_needed(2, [0.5, 1.0], [0.01, 0.01], [0, 0], DECODE) == 3
    # TPOT 0.2 s against a 0.1 s SLO doubles the pool even with little KV in use.
    assert decode_replicas_needed(2, [0.1, 0.1], [0.2, 0.2], [0, 0], DECODE) == 4
    # Quiet pool shrinks, never below one replica.
    assert decode_replicas_needed(4, [0.1] * 4, [0.01] * 4, [0] * 4, DECODE) == 1
    # Requests waiting for KV on a full pool add a replica even if the ratio rounds down.
    assert decode_replicas_needed(2, [0.5, 0.5], [0.0, 0.0], [3, 0], DECODE) == 3


def context(metrics: dict[str, dict[str, float]] | None, current: int) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=DeploymentID(name="d", app_name="a"),
        deployment_name="d",
        app_name="a",
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=[],
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=0,
        capacity_adjusted_max_replicas=10,
        policy_state={"kept": 1},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=AutoscalingConfig(min_replicas=0, max_replicas=10),
    )


def test_policies_read_replica_stats_from_the_serve_context() -> None:
    prefill = PrefillAutoscalingPolicy(
        ttft_ms=1000, default_tokens_per_s=1000.0, target_utilization=0.5
    )
    ctx = context(
        {"prompt_tokens_per_s": {"r1": 2000.0}, "prefill_tokens_per_s": {"r1": 1000.0},
         "queued_prefill_tokens": {"r1": 0.0}},
        current=1,
    )  # fmt: skip
    assert prefill(ctx) == (4, {"kept": 1})
    decode = DecodeAutoscalingPolicy(tpot_ms=100, target_kv_usage=0.5)
    ctx = context(
        {"kv_usage": {"r1": 0.9, "r2": 0.7}, "tpot_s": {"r1": 0.01, "r2": 0.01}}, current=2
    )
    assert decode(ctx)[0] == 4


@pytest.mark.parametrize("policy", [
    PrefillAutoscalingPolicy(ttft_ms=1000, default_tokens_per_s=1000.0),
    DecodeAutoscalingPolicy(tpot_ms=100),
])  # fmt: skip
def test_without_reports_the_pool_holds_its_size(policy: object) -> None:
    assert policy(context(None, current=3)) == (3, {"kept": 1})  # type: ignore[operator]


def test_load_meters_feed_the_policies_sensible_numbers() -> None:
    from pdserve.deployments.load import Ema, RateMeter

    now = [0.0]
    meter = RateMeter(window_s=10.0, clock=lambda: now[0])
    meter.add(500)
    now[0] = 5.0
    meter.add(1500)
    assert meter.rate() == pytest.approx(200.0)  # 2000 tokens over the 10 s window
    now[0] = 12.0
    assert meter.rate() == pytest.approx(150.0)  # the first 500 fell out of the window
    ema = Ema(alpha=0.5)
    assert ema.value == 0.0
    ema.add(4.0)
    ema.add(2.0)
    assert ema.value == pytest.approx(3.0)
