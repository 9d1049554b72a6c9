"""Custom Serve autoscaling policies: prefill sized by prompt-token arrival vs the TTFT SLO,
decode sized by KV usage vs the TPOT SLO.

Ray 2.60 calls ``autoscaling_config.policy.policy_function`` with an ``AutoscalingContext``;
a class given there is instantiated once with ``policy.policy_kwargs`` and then called per
tick. Serve itself applies the up/downscale delays, scaling factors and min/max bounds
around what these policies return. The signals come from the replicas'
``record_autoscaling_stats()`` (names in ``PREFILL_METRICS`` / ``DECODE_METRICS``),
averaged by Serve over ``look_back_period_s``.

The sizing math is in pure functions (``prefill_replicas_needed``, ``decode_replicas_needed``,
``plan_pools`` which sizes both pools together with hysteresis and never shrinks decode below
what its running requests need) unit-tested without Ray. Besides KV usage (reserved blocks
of in-flight remote prefills included: they are allocated) and TPOT, decode sizing counts
two pressures the averages hide: remote prefills refused a KV reservation
(``KV_REFUSED_PER_S``: each then prefills locally), and the prompts the disaggregation
policy keeps on the decode replicas while the prefill pool is saturated
(``local_prefill_load``: their queue must drain within the TTFT SLO).
Demand that never reached a replica counts too: requests turned away for lack of capacity
(``TURNED_AWAY_PER_S``: the decode replica's own admission sheds, and the ingress's door
sheds on the pool's drain hint or a full Serve queue, which the ingress reports to a decode
replica, ``DecodeServer.report_turned_away``) against what the pool admits
(``ADMITTED_PER_S``). While the pool turns a share of its demand away (``shedding``) it is
saturated: it grows and never shrinks, and the most it admits per replica then is its
capacity (``saturated_rate``, kept in the policy state); the pool is sized by its whole
demand over that capacity (``demand_replicas``), a shrink only where the smaller pool keeps
the scale-down margin. Sheds more decode replicas would not fix (the ingress's or the
proxy's own lag) are not reported, so they neither grow the pool nor make it flap.
``JointAutoscalingPolicy`` is Serve's application-level ``autoscaling_policy`` (one
decision for both pools, from a Serve config's ``applications[].autoscaling_policy``); the
per-deployment policies, which ``serve.run`` attaches, call the same ``plan_pools`` with
what their own pool reports.
This module must stay importable inside the Serve controller:
it imports only the standard library at module level.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ray.serve")

# Names of the custom metrics each replica reports (record_autoscaling_stats keys).
PROMPT_TOKENS_PER_S = "prompt_tokens_per_s"  # prompt tokens arriving per second
PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"  # measured prefill throughput (capacity)
QUEUED_PREFILL_TOKENS = "queued_prefill_tokens"
KV_USAGE = "kv_usage"  # fraction of KV blocks in use, 0..1
TPOT_S = "tpot_s"  # measured time per output token of the running batch
NUM_WAITING = "num_waiting"
NUM_IN_BATCH = "num_in_batch"  # decode: requests running or waiting (for the scale-down check)
# decode: remote prefills per second refused for lack of KV room to reserve the prompt
# (prefilled locally instead); optional, a pool that does not report it is sized without it.
KV_REFUSED_PER_S = "kv_refused_per_s"
# decode: requests admitted per second, and requests turned away for lack of capacity per
# second (this replica's admission sheds plus the ingress's capacity sheds reported to it).
ADMITTED_PER_S = "admitted_per_s"
TURNED_AWAY_PER_S = "turned_away_per_s"
# policy state: requests per second one decode replica admits when the pool is saturated.
SATURATED_RATE_KEY = "pdserve_saturated_rps_per_replica"
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
    kv_refused_per_s: Sequence[float] = (),
    num_in_batch: Sequence[float] = (),
) -> int:
    """Replicas so that mean KV usage stays under ``target_kv_usage`` and the measured TPOT
    under ``target_tpot_fraction`` x SLO; requests waiting for KV add one replica, and so do
    remote prefills refused a KV reservation (the pool is out of room where it matters,
    whatever the mean says). With ``num_in_batch`` (each replica's running and waiting
    requests), the TPOT term asks for at most one replica per request in flight: spreading
    b sequences over more than b replicas cannot shorten their TPOT (a TPOT that is high
    at a batch of one is the step itself, or replicas sharing cores, not load)."""
    if current <= 0:
        return 1
    kv = sum(kv_usage) / len(kv_usage) if kv_usage else 0.0
    tpot = sum(tpot_s) / len(tpot_s) if tpot_s else 0.0
    by_kv = current * kv / s.target_kv_usage
    by_tpot = current * tpot / (s.tpot_s * s.target_tpot_fraction)
    if num_in_batch:  # reported
        by_tpot = min(by_tpot, max(1.0, sum(num_in_batch)))
    needed = math.ceil(max(by_kv, by_tpot) - 1e-9)
    if sum(num_waiting) > 0 and kv >= s.target_kv_usage:
        needed = max(needed, current + 1)
    if sum(kv_refused_per_s) > 0:
        needed = max(needed, current + 1)
    return max(needed, 1)


@dataclass(frozen=True)
class DemandSizing:
    """Sizing from turned-away demand: a pool turning away at least ``min_shed_fraction``
    of its demand (admitted + turned away), and at least ``min_turned_away_per_s``, is
    saturated (the floor keeps a stray shed at a low rate, one request in the window,
    from reading as saturation)."""

    min_shed_fraction: float = 0.05
    min_turned_away_per_s: float = 0.2

    def __post_init__(self) -> None:
        if not 0 < self.min_shed_fraction < 1:
            raise ValueError(f"min_shed_fraction must be in (0, 1), got {self.min_shed_fraction}")
        if self.min_turned_away_per_s < 0:
            raise ValueError(
                f"min_turned_away_per_s must be >= 0, got {self.min_turned_away_per_s}"
            )


def shedding(admitted_per_s: float, turned_away_per_s: float, s: DemandSizing) -> bool:
    """Whether the pool turns away at least ``min_shed_fraction`` of its demand, and at
    least ``min_turned_away_per_s``."""
    demand = admitted_per_s + turned_away_per_s
    return (
        demand > 0
        and turned_away_per_s >= s.min_shed_fraction * demand
        and turned_away_per_s >= s.min_turned_away_per_s
    )


def saturated_rate(
    previous: float | None,
    current: int,
    admitted_per_s: float,
    turned_away_per_s: float,
    s: DemandSizing,
) -> float | None:
    """Requests per second one replica admits when the pool is full: the most it was seen
    admitting per replica while the pool shed (a pool starved by something else, a busy
    machine or a replica starting beside it, admits less and teaches nothing), raised by
    any larger rate admitted without shedding (a lower bound of what it takes). None until
    the pool first saturates."""
    if current < 1 or admitted_per_s <= 0:
        return previous
    sample = admitted_per_s / current
    if previous is None:
        return sample if shedding(admitted_per_s, turned_away_per_s, s) else None
    return max(previous, sample)


def demand_replicas(
    current: int,
    admitted_per_s: float,
    turned_away_per_s: float,
    per_replica_rate: float | None,
    s: DemandSizing,
    utilization: float = 1.0,
) -> int:
    """Replicas for the whole demand (admitted + turned away) at ``utilization`` of the
    saturated per-replica rate; a saturated pool grows by one at least (the rate is the
    best it showed, so demand over it may round to the current size). 0 (no say) while not
    saturated and no rate is known."""
    saturated = shedding(admitted_per_s, turned_away_per_s, s)
    floor = current + 1 if saturated else 0
    if per_replica_rate is None or per_replica_rate <= 0:
        return floor
    demand = admitted_per_s + turned_away_per_s
    return max(floor, math.ceil(demand / (per_replica_rate * utilization) - 1e-9))


@dataclass(frozen=True)
class PoolLoad:
    """One pool's replica count and its replicas' reports (metric name -> one value per
    replica; a missing name means no replica reported it)."""

    current: int
    metrics: Mapping[str, Sequence[float]]

    def values(self, name: str) -> list[float]:
        return [float(v) for v in self.metrics.get(name, ())]


@dataclass(frozen=True)
class JointSizing:
    prefill: PrefillSizing
    decode: DecodeSizing
    max_num_seqs: int  # per decode replica
    down_margin: float = 0.25  # shrink only when the load fits with this much to spare
    max_kv_after_scale_down: float = 0.85  # KV a smaller decode pool may be left holding
    demand: DemandSizing = DemandSizing()

    def __post_init__(self) -> None:
        if not 0 <= self.down_margin < 1:
            raise ValueError(f"down_margin must be in [0, 1), got {self.down_margin}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


def with_hysteresis(current: int, needed_up: int, needed_down: int) -> int:
    """Grow to ``needed_up`` at once; shrink only to ``needed_down`` (sized with a margin, so
    a load at the boundary does not flap); otherwise hold."""
    if needed_up > current:
        return needed_up
    if needed_down < current:
        return max(needed_down, needed_up)
    return current


def decode_fits(
    replicas: int, kv_usage: Sequence[float], num_in_batch: Sequence[float], s: JointSizing
) -> bool:
    """Whether the decode pool's current requests fit on ``replicas`` replicas: their KV
    under ``max_kv_after_scale_down`` of the smaller pool, their count within its slots."""
    if replicas < 1:
        return False
    kv_fits = sum(kv_usage) <= replicas * s.max_kv_after_scale_down
    return kv_fits and sum(num_in_batch) <= replicas * s.max_num_seqs


def plan_decode(
    decode: PoolLoad,
    s: JointSizing,
    prompt_load: int = 0,
    prompt_load_down: int | None = None,
    saturated_rps: float | None = None,
) -> int:
    """Decode replicas from KV usage, TPOT and KV refusals (and ``prompt_load``: the
    replicas its local prefills need; ``prompt_load_down``, sized with the scale-down
    margin, bounds a shrink, default ``prompt_load``), and from the whole demand, turned
    away included, over ``saturated_rps`` (``saturated_rate``), with hysteresis, never
    below what the running requests need."""
    kv, tpot, waiting = (decode.values(n) for n in (KV_USAGE, TPOT_S, NUM_WAITING))
    refused, in_batch = decode.values(KV_REFUSED_PER_S), decode.values(NUM_IN_BATCH)
    needed = decode_replicas_needed(decode.current, kv, tpot, waiting, s.decode, refused, in_batch)
    admitted, away = sum(decode.values(ADMITTED_PER_S)), sum(decode.values(TURNED_AWAY_PER_S))
    saturated = shedding(admitted, away, s.demand)
    if not saturated:
        away = 0.0  # an odd shed (a misprediction, a burst) is not demand to size for
    margin = 1 - s.down_margin
    demand_up = demand_replicas(decode.current, admitted, away, saturated_rps, s.demand)
    demand_down = demand_replicas(decode.current, admitted, away, saturated_rps, s.demand, margin)
    up = max(needed, prompt_load, demand_up)
    strict = DecodeSizing(
        s.decode.tpot_s, s.decode.target_kv_usage * margin, s.decode.target_tpot_fraction * margin
    )
    down = max(
        decode_replicas_needed(decode.current, kv, tpot, waiting, strict, refused, in_batch),
        prompt_load if prompt_load_down is None else prompt_load_down,
        demand_down,
    )
    if saturated:
        down = max(down, decode.current)  # turning demand away: never shrink
    target = with_hysteresis(decode.current, up, down)
    while target < decode.current and not decode_fits(target, kv, in_batch, s):
        target += 1  # its requests would not fit elsewhere: keep the replica
    return target


def plan_prefill(prefill: PoolLoad, s: JointSizing, arrival_tokens_per_s: float | None) -> int:
    """Prefill replicas from prompt-token arrival x measured prefill cost vs the TTFT SLO,
    with hysteresis. ``arrival_tokens_per_s`` (what the decode pool saw arrive) replaces the
    prefill replicas' own count when larger: the decode side sees a surge first."""
    arrival = prefill.values(PROMPT_TOKENS_PER_S)
    if arrival_tokens_per_s is not None and arrival_tokens_per_s > sum(arrival):
        arrival = [arrival_tokens_per_s]
    capacity, queued = prefill.values(PREFILL_TOKENS_PER_S), prefill.values(QUEUED_PREFILL_TOKENS)
    up = prefill_replicas_needed(prefill.current, arrival, capacity, queued, s.prefill)
    strict = PrefillSizing(
        s.prefill.ttft_s * (1 - s.down_margin),
        s.prefill.default_tokens_per_s,
        s.prefill.target_utilization * (1 - s.down_margin),
    )
    down = prefill_replicas_needed(prefill.current, arrival, capacity, queued, strict)
    return with_hysteresis(prefill.current, up, down)


def local_prefill_load(decode: PoolLoad, s: JointSizing) -> tuple[int, int]:
    """(up, down): decode replicas that the prompts queued for prefill on the decode replicas
    need to drain within the TTFT SLO at their measured local prefill rate (the configured
    prefill rate until one is measured: an overestimate, so it errs towards fewer). With a
    prefill pool these are the prompts the disaggregation policy keeps local while that pool
    is saturated, plus the short ones; ``down`` uses the scale-down margin. (0, 0) when
    nothing is queued."""
    queued = decode.values(QUEUED_PREFILL_TOKENS)
    if sum(queued) <= 0:
        return 0, 0
    rates = decode.values(PREFILL_TOKENS_PER_S)
    up = prefill_replicas_needed(decode.current, (), rates, queued, s.prefill)
    strict = PrefillSizing(
        s.prefill.ttft_s * (1 - s.down_margin),
        s.prefill.default_tokens_per_s,
        s.prefill.target_utilization,
    )
    return up, prefill_replicas_needed(decode.current, (), rates, queued, strict)


def plan_pools(
    prefill: PoolLoad | None,
    decode: PoolLoad,
    s: JointSizing,
    saturated_rps: float | None = None,
) -> tuple[int | None, int]:
    """(prefill, decode) replica counts decided together. Without a prefill pool (None) the
    decode replicas prefill every prompt, so the prompt load sizes decode too; with one,
    the prompts queued for local prefill on the decode replicas (``local_prefill_load``)
    do. ``saturated_rps`` sizes decode by its whole demand (``plan_decode``)."""
    arrival = (
        sum(decode.values(PROMPT_TOKENS_PER_S)) if decode.values(PROMPT_TOKENS_PER_S) else None
    )
    if prefill is None:
        local = PoolLoad(
            decode.current,
            {k: decode.values(k) for k in (PREFILL_TOKENS_PER_S, QUEUED_PREFILL_TOKENS)}
            | {PROMPT_TOKENS_PER_S: [arrival or 0.0]},
        )
        prompt_load = plan_prefill(local, s, None) if arrival else 0
        return None, plan_decode(decode, s, prompt_load, saturated_rps=saturated_rps)
    spill_up, spill_down = local_prefill_load(decode, s)
    n_decode = plan_decode(decode, s, spill_up, spill_down, saturated_rps)
    return plan_prefill(prefill, s, arrival), n_decode


def update_saturated_rate(
    state: Mapping[str, Any], decode: PoolLoad, s: JointSizing
) -> float | None:
    """The decode pool's saturated per-replica rate after this tick's reports (the previous
    one from ``state[SATURATED_RATE_KEY]``)."""
    previous = state.get(SATURATED_RATE_KEY)
    return saturated_rate(
        float(previous) if previous is not None else None,
        decode.current,
        sum(decode.values(ADMITTED_PER_S)),
        sum(decode.values(TURNED_AWAY_PER_S)),
        s.demand,
    )


def _with_rate(state: Mapping[str, Any] | None, rate: float | None) -> dict[str, Any]:
    out = dict(state or {})
    if rate is not None:
        out[SATURATED_RATE_KEY] = rate
    return out


def _values(ctx: Any, name: str) -> list[float]:
    metrics: Mapping[str, Mapping[Any, float]] | None = ctx.aggregated_metrics
    if not metrics or name not in metrics:
        return []
    return [float(v) for v in metrics[name].values()]


class PoolGauges:
    """``pdserve_pool_replicas{pool}`` (the count Serve is scaling the pool to) and
    ``pdserve_pool_replicas_wanted{pool}`` (the policy's sizing, before Serve's delays and
    bounds), set from the controller. Best effort: a metrics failure never stops
    autoscaling; no model name, no gauges."""

    def __init__(self, model_name: str | None) -> None:
        self._model = model_name
        self._gauge: Any = None

    def record(self, pool: str, target: int | None, wanted: int | None) -> None:
        if self._model is None:
            return
        try:
            if self._gauge is None:
                from pdserve.deployments.metrics import PoolReplicaGauge

                self._gauge = PoolReplicaGauge(self._model)
            if target is not None:
                self._gauge.set(pool, target)
            if wanted is not None:
                self._gauge.set_wanted(pool, wanted)
        except Exception:  # noqa: BLE001
            self._model = None


class PrefillAutoscalingPolicy:
    """``policy_function`` for the prefill deployment (kwargs: ttft_ms, default_tokens_per_s,
    target_utilization)."""

    def __init__(
        self,
        ttft_ms: float,
        default_tokens_per_s: float,
        target_utilization: float = 0.7,
        down_margin: float = 0.0,
        model_name: str | None = None,
    ) -> None:
        self.sizing = PrefillSizing(ttft_ms / 1000.0, default_tokens_per_s, target_utilization)
        self.joint = JointSizing(self.sizing, DecodeSizing(1.0), 1, down_margin)
        self.gauges = PoolGauges(model_name)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        if not _values(ctx, PROMPT_TOKENS_PER_S):  # no reports yet: hold steady
            self.gauges.record("prefill", ctx.target_num_replicas, None)
            return ctx.target_num_replicas, ctx.policy_state
        wanted = plan_prefill(_pool_load(ctx), self.joint, None)
        self.gauges.record("prefill", ctx.target_num_replicas, wanted)
        return wanted, ctx.policy_state


class DecodeAutoscalingPolicy:
    """``policy_function`` for the decode deployment (kwargs: tpot_ms, target_kv_usage;
    ttft_ms and default_tokens_per_s to size the prompts prefilled on this pool;
    min_shed_fraction: the share of turned-away demand that marks the pool saturated)."""

    def __init__(
        self,
        tpot_ms: float,
        target_kv_usage: float = 0.75,
        max_num_seqs: int = 1_000_000,
        down_margin: float = 0.0,
        ttft_ms: float | None = None,
        default_tokens_per_s: float | None = None,
        prefills_locally: bool | None = None,
        min_shed_fraction: float = 0.05,
        model_name: str | None = None,
    ) -> None:
        self.sizing = DecodeSizing(tpot_ms / 1000.0, target_kv_usage)
        # ttft_ms and default_tokens_per_s let the prompts prefilled on this pool size it:
        # every prompt when it prefills locally (no prefill pool; the default when both
        # are given), else the local queue the policy keeps while the prefill pool is
        # saturated (``local_prefill_load``).
        self.knows_ttft = ttft_ms is not None and default_tokens_per_s is not None
        self.prefills_locally = self.knows_ttft if prefills_locally is None else prefills_locally
        if self.prefills_locally and not self.knows_ttft:
            raise ValueError("prefills_locally needs ttft_ms and default_tokens_per_s")
        prefill = PrefillSizing((ttft_ms or 1000.0) / 1000.0, default_tokens_per_s or 1.0)
        self.joint = JointSizing(
            prefill, self.sizing, max_num_seqs, down_margin, demand=DemandSizing(min_shed_fraction)
        )
        self.gauges = PoolGauges(model_name)
        self._last_wanted: int | None = None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        if not _values(ctx, KV_USAGE):
            self.gauges.record("decode", ctx.target_num_replicas, None)
            return ctx.target_num_replicas, ctx.policy_state
        decode = _pool_load(ctx)
        rate = update_saturated_rate(ctx.policy_state or {}, decode, self.joint)
        if self.prefills_locally:
            wanted = plan_pools(None, decode, self.joint, rate)[1]
        elif self.knows_ttft:
            spill = local_prefill_load(decode, self.joint)
            wanted = plan_decode(decode, self.joint, *spill, saturated_rps=rate)
        else:
            wanted = plan_decode(decode, self.joint, saturated_rps=rate)
        self.gauges.record("decode", ctx.target_num_replicas, wanted)
        if wanted != self._last_wanted:
            self._last_wanted = wanted
            logger.info("pdserve decode autoscaling: %s", describe_decode(decode, wanted, rate))
        return wanted, _with_rate(ctx.policy_state, rate)


def describe_decode(decode: PoolLoad, wanted: int, rate: float | None) -> str:
    """One line for the controller's log when the decode sizing changes."""

    def total(name: str) -> float:
        return sum(decode.values(name))

    kv, tpot = decode.values(KV_USAGE), decode.values(TPOT_S)
    return (
        f"wants {wanted} (running {decode.current}); admitted {total(ADMITTED_PER_S):.2f}/s, "
        f"turned away {total(TURNED_AWAY_PER_S):.2f}/s, saturated rate per replica "
        f"{'-' if rate is None else f'{rate:.2f}/s'}, mean KV "
        f"{sum(kv) / max(1, len(kv)):.2f}, mean TPOT {sum(tpot) / max(1, len(tpot)):.3f}s, "
        f"in batch {total(NUM_IN_BATCH):.0f}"
    )


def _pool_load(ctx: Any) -> PoolLoad:
    metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
    return PoolLoad(
        ctx.current_num_replicas, {k: [float(v) for v in m.values()] for k, m in metrics.items()}
    )


class JointAutoscalingPolicy:
    """Serve's application-level ``autoscaling_policy``: sizes the prefill and decode
    deployments in one decision (``plan_pools``) from both pools' reports. Deployments it
    does not know (the ingress) keep their target."""

    def __init__(
        self,
        *,
        prefill_deployment: str | None,
        decode_deployment: str,
        ttft_ms: float,
        tpot_ms: float,
        default_tokens_per_s: float,
        max_num_seqs: int,
        target_utilization: float = 0.7,
        target_kv_usage: float = 0.75,
        down_margin: float = 0.25,
        min_shed_fraction: float = 0.05,
        model_name: str | None = None,
    ) -> None:
        self.names = {"prefill": prefill_deployment, "decode": decode_deployment}
        self.sizing = JointSizing(
            PrefillSizing(ttft_ms / 1000.0, default_tokens_per_s, target_utilization),
            DecodeSizing(tpot_ms / 1000.0, target_kv_usage),
            max_num_seqs,
            down_margin,
            demand=DemandSizing(min_shed_fraction),
        )
        self.gauges = PoolGauges(model_name)

    def __call__(self, contexts: Mapping[Any, Any]) -> tuple[dict[Any, int], dict[Any, dict]]:
        by_name = {dep_id.name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        decisions = {dep_id: ctx.target_num_replicas for dep_id, ctx in contexts.items()}
        states = {dep_id: dict(ctx.policy_state or {}) for dep_id, ctx in contexts.items()}
        decode = by_name.get(self.names["decode"])
        if decode is None or not _values(decode[1], KV_USAGE):
            return decisions, states  # no reports yet: hold steady
        prefill = by_name.get(self.names["prefill"] or "")
        decode_load = _pool_load(decode[1])
        rate = update_saturated_rate(states[decode[0]], decode_load, self.sizing)
        states[decode[0]] = _with_rate(states[decode[0]], rate)
        n_prefill, n_decode = plan_pools(
            _pool_load(prefill[1]) if prefill is not None else None,
            decode_load,
            self.sizing,
            rate,
        )
        decisions[decode[0]] = n_decode
        self.gauges.record("decode", decode[1].target_num_replicas, n_decode)
        if (
            prefill is not None
            and n_prefill is not None
            and _values(prefill[1], PROMPT_TOKENS_PER_S)
        ):
            decisions[prefill[0]] = n_prefill
            self.gauges.record("prefill", prefill[1].target_num_replicas, n_prefill)
        return decisions, states


POLICY_PATHS = {
    "prefill": f"{__name__}:PrefillAutoscalingPolicy",
    "decode": f"{__name__}:DecodeAutoscalingPolicy",
}
APPLICATION_POLICY_PATH = f"{__name__}:JointAutoscalingPolicy"
