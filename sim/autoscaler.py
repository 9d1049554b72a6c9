"""Autoscaling in the simulated cluster: the live policies of
``pdserve.deployments.autoscaling``, built as pdserve deploys them and called every
``SimSettings.autoscale_period_s`` with ``AutoscalingContext``-shaped objects whose metrics
are each replica's live ``load.*_autoscaling_stats`` (plus ``kv_refused_per_s``: remote
prefills its engine had no KV room to reserve for). ``SimSettings.autoscaling_policy``
picks which:

- ``"deployment"``: one policy per pool, as ``serve.run`` attaches them
  (``app.autoscaling_config``: class path and kwargs);
- ``"application"``: the joint ``JointAutoscalingPolicy`` that a Serve config deploys
  (``app.application_autoscaling_policy``), one decision for both pools from both pools'
  reports.

Around them, what Serve does: the min/max bounds, a new target acting only after it held
for upscale/downscale_delay_s, new replicas serving after ``replica_startup_s``, removed
ones draining first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, NamedTuple

from pdserve.deployments import autoscaling
from pdserve.deployments.app import (
    DECODE_DEPLOYMENT,
    PREFILL_DEPLOYMENT,
    application_autoscaling_policy,
    autoscaling_config,
)
from pdserve.deployments.load import decode_autoscaling_stats, prefill_autoscaling_stats
from pdserve.sim.config import ROLES

if TYPE_CHECKING:
    from pdserve.deployments.config import AppConfig, PoolConfig, PoolRole
    from pdserve.sim.cluster import SimCluster
    from pdserve.sim.replica import SimReplica

DEPLOYMENTS = {"prefill": PREFILL_DEPLOYMENT, "decode": DECODE_DEPLOYMENT}


class DeploymentKey(NamedTuple):
    """What an application-level policy keys its contexts by (Serve's ``DeploymentID``)."""

    name: str
    app_name: str = "pdserve"


def _build(spec: dict[str, Any]) -> Any:
    module, _, name = spec["policy_function"].partition(":")
    return getattr(importlib.import_module(module), name)(**spec["policy_kwargs"])


def live_policy(app: AppConfig, role: PoolRole) -> Any:
    """The pool's policy object as Serve would build it; None when the pool does not scale."""
    pool = app.pool(role)
    if not app.autoscaling or pool.min_replicas == pool.max_replicas:
        return None
    return _build(autoscaling_config(app, role)["policy"])


def live_application_policy(app: AppConfig) -> Any:
    """The joint policy as a Serve config deploys it; None without autoscaling."""
    return _build(application_autoscaling_policy(app)) if app.autoscaling else None


class Context(NamedTuple):
    """The fields of Serve's ``AutoscalingContext`` the policies read."""

    aggregated_metrics: dict[str, dict[str, float]]
    current_num_replicas: int
    target_num_replicas: int
    policy_state: dict[str, Any]


class SimAutoscaler:
    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.joint = (
            live_application_policy(cluster.app)
            if cluster.s.autoscaling_policy == "application"
            else None
        )
        self.policies = {
            role: None if self.joint is not None else live_policy(cluster.app, role)
            for role in ROLES
        }
        self._want: dict[PoolRole, tuple[int, float]] = {}  # role -> (target, since)

    @property
    def active(self) -> bool:
        return self.joint is not None or any(self.policies.values())

    def metrics(self, role: PoolRole) -> dict[str, dict[str, float]]:
        """Serve's ``aggregated_metrics``: each ready replica's ``record_autoscaling_stats``
        (the live ``load.*_autoscaling_stats``), by metric name then replica."""
        out: dict[str, dict[str, float]] = {}
        for r in self.cluster.pools[role]:
            if not r.ready:
                continue
            rate = r.arrivals.rate() if r.arrivals else 0.0
            stats = r.engine.stats()
            if role == "prefill":
                report = prefill_autoscaling_stats(stats, rate)
            else:
                report = decode_autoscaling_stats(stats, r.itl.value, rate)
                report[autoscaling.KV_REFUSED_PER_S] = (
                    r.kv_refused.rate() if r.kv_refused is not None else 0.0
                )
            for name, value in report.items():
                out.setdefault(name, {})[r.replica_id] = value
        return out

    def _context(self, role: PoolRole) -> Context:
        live = [r for r in self.cluster.pools[role] if not r.draining]
        return Context(self.metrics(role), sum(r.ready for r in live), len(live), {})

    def tick(self) -> None:
        c = self.cluster
        now = c.loop.now
        wanted: dict[PoolRole, int] = {}
        if self.joint is not None:
            contexts = {DeploymentKey(DEPLOYMENTS[role]): self._context(role) for role in ROLES}
            decisions, _ = self.joint(contexts)
            wanted = {role: decisions[DeploymentKey(DEPLOYMENTS[role])] for role in ROLES}
        for role, policy in self.policies.items():
            if policy is not None:
                wanted[role], _ = policy(self._context(role))
        for role, n in wanted.items():
            pool = c.app.pool(role)
            if pool.min_replicas == pool.max_replicas:
                continue
            live = [r for r in c.pools[role] if not r.draining]
            n = min(max(n, pool.min_replicas), pool.max_replicas)
            self._apply(role, pool, live, n, now)
        c.timeline.append(
            (now, *(sum(not r.draining for r in c.pools[p]) for p in ROLES))  # type: ignore[arg-type]
        )
        if c.open_requests > 0:
            c.loop.after(c.s.autoscale_period_s, self.tick)

    def _apply(
        self, role: PoolRole, pool: PoolConfig, live: list[SimReplica], wanted: int, now: float
    ) -> None:
        """Serve's delays: a new target holds for upscale/downscale_delay_s before it acts."""
        if wanted == len(live):
            self._want.pop(role, None)
            return
        target, since = self._want.get(role, (wanted, now))
        if (target > len(live)) != (wanted > len(live)):
            since = now
        self._want[role] = (wanted, since)
        delay = pool.upscale_delay_s if wanted > len(live) else pool.downscale_delay_s
        if now - since < delay:
            return
        self._want.pop(role, None)
        c = self.cluster
        for _ in range(wanted - len(live)):
            c.start_replica(role, ready_in=c.s.replica_startup_s)
        for replica in sorted(live, key=lambda r: r.ongoing)[: max(0, len(live) - wanted)]:
            c.drain(replica)
