"""Autoscaling math: prefill from prompt-token arrival vs TTFT, decode from KV usage vs TPOT."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from pdserve.deployments.autoscaling import (
    SATURATED_RATE_KEY,
    DecodeAutoscalingPolicy,
    DecodeSizing,
    DemandSizing,
    JointAutoscalingPolicy,
    JointSizing,
    PoolLoad,
    PrefillAutoscalingPolicy,
    PrefillSizing,
    decode_fits,
    decode_replicas_needed,
    demand_replicas,
    local_prefill_load,
    plan_decode,
    plan_pools,
    prefill_replicas_needed,
    saturated_rate,
    shedding,
    with_hysteresis,
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


@dataclass(frozen=True)
class DeploymentID:
    """Stands in for the key Serve gives each deployment's context (its ``DeploymentID``,
    which Ray has no public constructor for): the policy reads its ``name`` and uses it as
    a dict key, as it would Serve's."""

    name: str
    app_name: str


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


JOINT = JointSizing(
    PrefillSizing(ttft_s=1.0, default_tokens_per_s=1000.0, target_utilization=0.5),
    DecodeSizing(tpot_s=0.1, target_kv_usage=0.5, target_tpot_fraction=1.0),
    max_num_seqs=8,
    down_margin=0.25,
)


def decode_load(
    current: int, kv: list[float], in_batch: list[float], **extra: list[float]
) -> PoolLoad:
    metrics = {"kv_usage": kv, "tpot_s": [0.01] * current, "num_waiting": [0.0] * current}
    return PoolLoad(current, {**metrics, "num_in_batch": in_batch, **extra})


def test_hysteresis_grows_at_once_and_shrinks_only_with_margin() -> None:
    assert with_hysteresis(2, needed_up=4, needed_down=5) == 4
    assert with_hysteresis(3, needed_up=2, needed_down=3) == 3  # within the band: hold
    assert with_hysteresis(3, needed_up=1, needed_down=2) == 2
    # Mean KV 0.45 on 2 replicas (target 0.5): fits 2 but not 1 with the 25 % margin.
    assert plan_decode(decode_load(2, [0.45, 0.45], [1, 1]), JOINT) == 2
    # Mean KV 0.15 on 2: one replica holds 0.3 < 0.375 -> shrink.
    assert plan_decode(decode_load(2, [0.15, 0.15], [1, 1]), JOINT) == 1


def test_decode_tpot_asks_for_at_most_a_replica_per_request_in_flight() -> None:
    """A TPOT over target with one request in flight on two replicas is the step itself
    (or replicas sharing cores), not load: spreading one sequence wider cannot shorten it,
    so the pool shrinks to one. The same TPOT with a full batch still grows the pool."""
    slow = [0.06, 0.06]  # 2 x 0.06 / 0.1 = 1.2: two replicas by the TPOT alone
    assert decode_replicas_needed(2, [0.01] * 2, slow, [0, 0], DECODE) == 2
    assert decode_replicas_needed(2, [0.01] * 2, slow, [0, 0], DECODE, (), [1, 0]) == 1
    assert decode_replicas_needed(2, [0.01] * 2, slow, [0, 0], DECODE, (), [6, 6]) == 2
    one_in_flight = decode_load(2, [0.01, 0.01], [1, 0], tpot_s=slow)
    assert plan_decode(one_in_flight, JOINT) == 1
    assert plan_decode(decode_load(2, [0.01, 0.01], [6, 6], tpot_s=slow), JOINT) == 2


def test_decode_never_shrinks_while_its_requests_would_not_fit_elsewhere() -> None:
    # Little KV but 12 requests in flight: one replica has 8 slots, so keep 2.
    assert plan_decode(decode_load(2, [0.05, 0.05], [6, 6]), JOINT) == 2
    assert not decode_fits(1, [0.05, 0.05], [6, 6], JOINT)
    assert decode_fits(2, [0.05, 0.05], [6, 6], JOINT)
    # KV that a smaller pool could not hold keeps the replica too (0.5 + 0.5 > 0.85).
    assert not decode_fits(1, [0.5, 0.5], [1, 1], JOINT)


def test_plan_pools_sizes_prefill_from_the_arrival_the_decode_pool_saw() -> None:
    # The prefill replicas report little yet, the decode pool admitted 2000 prompt tok/s:
    # 1000 tok/s per prefill replica at 50 % -> 4 prefill replicas, decode unchanged.
    prefill = PoolLoad(1, {"prompt_tokens_per_s": [100.0], "prefill_tokens_per_s": [1000.0],
                           "queued_prefill_tokens": [0.0]})  # fmt: skip
    decode = decode_load(1, [0.3], [2], prompt_tokens_per_s=[2000.0])
    assert plan_pools(prefill, decode, JOINT) == (4, 1)


def test_without_a_prefill_pool_the_prompt_load_sizes_decode() -> None:
    decode = decode_load(
        1, [0.1], [2], prompt_tokens_per_s=[1500.0], prefill_tokens_per_s=[1000.0],
        queued_prefill_tokens=[0.0],
    )  # fmt: skip
    assert plan_pools(None, decode, JOINT) == (None, 3)


def test_application_policy_decides_both_pools_together() -> None:
    policy = JointAutoscalingPolicy(
        prefill_deployment="P", decode_deployment="D", ttft_ms=1000, tpot_ms=100,
        default_tokens_per_s=1000.0, max_num_seqs=8, target_utilization=0.5,
        target_kv_usage=0.5,
    )  # fmt: skip
    p_id, d_id, i_id = (DeploymentID(name=n, app_name="a") for n in ("P", "D", "I"))
    p_ctx = context(
        {"prompt_tokens_per_s": {"p1": 2000.0}, "prefill_tokens_per_s": {"p1": 1000.0},
         "queued_prefill_tokens": {"p1": 0.0}},
        current=1,
    )  # fmt: skip
    d_ctx = context({"kv_usage": {"d1": 0.9, "d2": 0.7}, "tpot_s": {"d1": 0.01, "d2": 0.01}}, 2)
    decisions, states = policy({p_id: p_ctx, d_id: d_ctx, i_id: context(None, current=1)})
    assert decisions == {p_id: 4, d_id: 4, i_id: 1}
    assert states[p_id] == {"kept": 1}
    # Before any decode report every pool holds.
    held, _ = policy({p_id: context(None, 2), d_id: context(None, 3)})
    assert held == {p_id: 2, d_id: 3}


def test_kv_refusals_add_a_decode_replica_whatever_the_mean_usage() -> None:
    # Mean KV 0.3 against a 0.5 target holds 2 replicas...
    assert decode_replicas_needed(2, [0.3, 0.3], [0.01, 0.01], [0, 0], DECODE) == 2
    assert plan_decode(decode_load(2, [0.3, 0.3], [1, 1]), JOINT) == 2
    # ...but remote prefills refused a KV reservation (prefilled locally instead) show the
    # pool out of room where it mattered: one more replica.
    refused = [0.5, 0.0]
    assert decode_replicas_needed(2, [0.3, 0.3], [0.01] * 2, [0, 0], DECODE, refused) == 3
    assert plan_decode(decode_load(2, [0.3, 0.3], [1, 1], kv_refused_per_s=refused), JOINT) == 3
    # No refusal in the window: the metric reads 0 and sizes nothing.
    quiet = decode_load(2, [0.3, 0.3], [1, 1], kv_refused_per_s=[0.0, 0.0])
    assert plan_decode(quiet, JOINT) == 2


def test_prompts_queued_for_local_prefill_on_decode_replicas_size_the_decode_pool() -> None:
    prefill = PoolLoad(4, {"prompt_tokens_per_s": [500.0] * 4, "prefill_tokens_per_s": [1000.0] * 4,
                           "queued_prefill_tokens": [0.0] * 4})  # fmt: skip

    def decode(queued: float, rate: float = 1000.0) -> PoolLoad:
        return decode_load(
            2, [0.3, 0.3], [4, 4], queued_prefill_tokens=[queued] * 2,
            prefill_tokens_per_s=[rate, 0.0], prompt_tokens_per_s=[1000.0] * 2,
        )  # fmt: skip

    # The prefill pool saturated, the policy kept 2 x 3000 tokens on the decode replicas:
    # at their measured 1000 tok/s they start within the 1 s TTFT on 6 replicas.
    assert local_prefill_load(decode(3000.0), JOINT) == (6, 8)
    assert plan_pools(prefill, decode(3000.0), JOINT) == (4, 6)
    # A short local queue (drains in 1 s on the 2 replicas) changes nothing; nor does none.
    assert local_prefill_load(decode(500.0), JOINT) == (1, 2)
    assert plan_pools(prefill, decode(500.0), JOINT) == (4, 2)
    assert plan_pools(prefill, decode(0.0), JOINT) == (4, 2)
    # No local rate measured yet: the configured prefill rate (1000 tok/s) stands in.
    assert local_prefill_load(decode(3000.0, rate=0.0), JOINT) == (6, 8)
    # The per-deployment decode policy does the same once it knows the TTFT SLO.
    policy = DecodeAutoscalingPolicy(
        tpot_ms=100, target_kv_usage=0.5, max_num_seqs=8, ttft_ms=1000,
        default_tokens_per_s=1000.0, prefills_locally=False,
    )  # fmt: skip
    metrics = {"kv_usage": {"a": 0.3, "b": 0.3}, "tpot_s": {"a": 0.01, "b": 0.01},
               "queued_prefill_tokens": {"a": 3000.0, "b": 3000.0},
               "prefill_tokens_per_s": {"a": 1000.0, "b": 0.0}}  # fmt: skip
    assert policy(context(metrics, current=2))[0] == 6
    # Without it (as deployed before), the local queue is not its business.
    assert DecodeAutoscalingPolicy(tpot_ms=100, target_kv_usage=0.5)(context(metrics, 2))[0] == 2
    with pytest.raises(ValueError, match="prefills_locally"):
        DecodeAutoscalingPolicy(tpot_ms=100, prefills_locally=True)


# ---------------------------------------------------------------- turned-away demand
DEMAND = DemandSizing(min_shed_fraction=0.05, min_turned_away_per_s=0.2)


def test_a_pool_is_saturated_when_it_turns_away_a_share_of_its_demand() -> None:
    assert shedding(9.0, 1.0, DEMAND)  # 1 of 10 requests/s turned away: 10 % >= 5 %
    assert not shedding(99.0, 1.0, DEMAND)  # 1 of 100: 1 %, an odd shed, not saturation
    assert not shedding(0.0, 0.0, DEMAND)  # idle
    # One stray shed at 1 req/s: 0.1 req/s over a 10 s window is 9 % of the demand, but
    # under the 0.2 req/s floor (the flap a ramp showed: 1 -> 2 replicas at 0.5x on it).
    assert not shedding(1.0, 0.1, DEMAND)
    assert shedding(1.0, 0.3, DEMAND)


def test_the_saturated_rate_is_the_most_a_replica_admitted_while_the_pool_shed() -> None:
    # One replica admits 9 req/s and 24 req/s are turned away: 9 req/s per replica.
    assert saturated_rate(None, 1, 9.0, 24.0, DEMAND) == 9.0
    # Two replicas starved by something else (the machine, a replica starting) admit 1
    # each while shedding: that teaches nothing, 9 stays.
    assert saturated_rate(9.0, 2, 2.0, 30.0, DEMAND) == 9.0
    # A larger rate while shedding (12 per replica) replaces it.
    assert saturated_rate(9.0, 2, 24.0, 10.0, DEMAND) == 12.0
    # Not saturated: what a replica admits is a lower bound. 30 req/s on 2 replicas
    # without sheds proves 15 per replica...
    assert saturated_rate(9.0, 2, 30.0, 0.0, DEMAND) == 15.0
    # ...a light load proves nothing new, and a pool never saturated has no rate.
    assert saturated_rate(15.0, 2, 4.0, 0.0, DEMAND) == 15.0
    assert saturated_rate(None, 2, 4.0, 0.0, DEMAND) is None


def test_the_whole_demand_sizes_the_pool_against_the_saturated_rate() -> None:
    # 9 admitted + 24 turned away = 33 req/s at 9 per replica -> ceil(3.67) = 4 replicas.
    assert demand_replicas(1, 9.0, 24.0, 9.0, DEMAND) == 4
    # Saturated but the demand rounds to the current size at the best rate seen (33 over
    # 2 x 20): grow by one all the same, the pool is turning requests away.
    assert demand_replicas(2, 30.0, 3.0, 20.0, DEMAND) == 3
    # After the surge: 4 req/s at 15 per replica, 75 % of it (the scale-down margin) -> 1.
    assert demand_replicas(2, 4.0, 0.0, 15.0, DEMAND, utilization=0.75) == 1
    # 30 req/s at 15 x 0.75 = 11.25 per replica -> ceil(2.67) = 3: no shrink from 2.
    assert demand_replicas(2, 30.0, 0.0, 15.0, DEMAND, utilization=0.75) == 3
    # No rate measured yet: no say, except that a saturated pool grows by one.
    assert demand_replicas(1, 5.0, 0.0, None, DEMAND) == 0
    assert demand_replicas(1, 0.0, 5.0, None, DEMAND) == 2


def test_door_sheds_for_capacity_grow_decode_and_hold_it_until_the_demand_falls() -> None:
    surge = decode_load(1, [0.05], [20.0], admitted_per_s=[9.0], turned_away_per_s=[24.0])
    # KV and TPOT alone keep one replica: the sheds are what the pool does not see...
    assert plan_decode(decode_load(1, [0.05], [20.0]), JOINT) == 1
    # ...counted as demand, 33 req/s over 9 per replica call for 4 (Serve caps at max).
    assert plan_decode(surge, JOINT, saturated_rps=9.0) == 4
    # Two replicas admitting 30 req/s without sheds (15 each): the margin keeps both.
    held = decode_load(2, [0.05] * 2, [10.0] * 2, admitted_per_s=[15.0] * 2,
                       turned_away_per_s=[0.0] * 2)  # fmt: skip
    assert plan_decode(held, JOINT, saturated_rps=15.0) == 2
    # Back to 4 req/s: one replica takes it with margin (4 <= 0.75 x 15) -> shrink.
    calm = decode_load(2, [0.02] * 2, [1.0] * 2, admitted_per_s=[2.0] * 2,
                       turned_away_per_s=[0.0] * 2)  # fmt: skip
    assert plan_decode(calm, JOINT, saturated_rps=15.0) == 1
    # Still turning 10 % away at 2 replicas: one more (Serve caps it at max_replicas), and
    # never fewer, whatever KV, TPOT or an optimistic rate (100 per replica) say.
    capped = decode_load(2, [0.02] * 2, [1.0] * 2, admitted_per_s=[9.0] * 2,
                         turned_away_per_s=[1.0] * 2)  # fmt: skip
    assert plan_decode(capped, JOINT, saturated_rps=100.0) == 3


def test_sheds_more_replicas_would_not_fix_do_not_size_the_pool() -> None:
    # The ingress reports only capacity sheds (its own lag is not decode's business). A pool
    # admitting all it is sent but an odd shed (1 %: a misprediction, a burst) is not
    # saturated: 99 req/s on 2 replicas raises the rate to 49.5, which sizes 2, not 3.
    rate = saturated_rate(30.0, 2, 99.0, 1.0, DEMAND)
    assert rate == 49.5
    odd = decode_load(2, [0.3] * 2, [5.0] * 2, admitted_per_s=[49.5] * 2,
                      turned_away_per_s=[0.5, 0.5])  # fmt: skip
    assert plan_decode(odd, JOINT, saturated_rps=rate) == 2


def test_decode_policy_learns_the_saturated_rate_in_its_state_and_sizes_by_demand() -> None:
    policy = DecodeAutoscalingPolicy(tpot_ms=100, target_kv_usage=0.5, max_num_seqs=64,
                                     down_margin=0.25)  # fmt: skip
    surge = {"kv_usage": {"a": 0.05}, "tpot_s": {"a": 0.01}, "num_in_batch": {"a": 20.0},
             "admitted_per_s": {"a": 9.0}, "turned_away_per_s": {"a": 24.0}}  # fmt: skip
    n, state = policy(context(surge, current=1))
    assert n == 4 and state == {"kept": 1, SATURATED_RATE_KEY: 9.0}
    # The next tick starts from that state: two replicas, 30 req/s admitted, no sheds.
    two = {"kv_usage": {"a": 0.05, "b": 0.05}, "tpot_s": {"a": 0.01, "b": 0.01},
           "num_in_batch": {"a": 10.0, "b": 10.0}, "admitted_per_s": {"a": 15.0, "b": 15.0},
           "turned_away_per_s": {"a": 0.0, "b": 0.0}}  # fmt: skip
    ctx = context(two, current=2)
    ctx.policy_state = state
    n, state = policy(ctx)
    assert n == 2 and state[SATURATED_RATE_KEY] == 15.0


def test_application_policy_counts_turned_away_demand_too() -> None:
    policy = JointAutoscalingPolicy(
        prefill_deployment=None, decode_deployment="D", ttft_ms=1000, tpot_ms=100,
        default_tokens_per_s=1000.0, max_num_seqs=64, target_kv_usage=0.5,
    )  # fmt: skip
    d_id = DeploymentID(name="D", app_name="a")
    surge = {"kv_usage": {"a": 0.05}, "tpot_s": {"a": 0.01}, "num_in_batch": {"a": 20.0},
             "admitted_per_s": {"a": 9.0}, "turned_away_per_s": {"a": 24.0}}  # fmt: skip
    decisions, states = policy({d_id: context(surge, current=1)})
    assert decisions == {d_id: 4}
    assert states[d_id][SATURATED_RATE_KEY] == 9.0
