"""Autoscaling in the simulated cluster: the live per-deployment policies of
``pdserve.deployments.autoscaling``, built as ``pdserve serve`` deploys them
(``app.autoscaling_config``: class path and kwargs) and called every
``SimSettings.autoscale_period_s`` with an ``AutoscalingContext``-shaped object whose
metrics are each replica's live ``load.*_autoscaling_stats``. Around them, what Serve does:
the min/max bounds, a new target acting only after it held for upscale/downscale_delay_s,
new replicas serving after ``replica_startup_s``, removed ones draining first.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pdserve.deployments.app import autoscaling_config
from pdserve.deployments.load import decode_autoscaling_stats, prefill_autoscaling_stats

if TYPE_CHECKING:
    from pdserve.sim.cluster import SimCluster, SimReplica

ROLES = ("prefill", "decode")


def live_policy(app: Any, role: str) -> Any:
    """The pool's policy object as Serve would build it; None when the pool does not scale."""
    pool = app.pool(role)
    if not app.autoscaling or pool.min_replicas == pool.max_replicas:
        return None
    policy = autoscaling_config(app, role)["policy"]
    module, _, name = policy["policy_function"].partition(":")
    return getattr(importlib.import_module(module), name)(**policy["policy_kwargs"])


class SimAutoscaler:
    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.policies = {role: live_policy(cluster.app, role) for role in ROLES}
        self._want: dict[str, tuple[int, float]] = {}  # role -> (target, since)

    @property
    def active(self) -> bool:
        return any(self.policies.values())

    def metrics(self, role: str) -> dict[str, dict[str, float]]:
        """Serve's ``aggregated_metrics``: each ready replica's ``record_autoscaling_stats``
        (the live ``load.*_autoscaling_stats``), by metric name then replica."""
        out: dict[str, dict[str, float]] = {}
        for r in self.cluster.pools[role]:
            if not r.ready:
                continue
            rate = r.arrivals.rate() if r.arrivals else 0.0
            stats = r.engine.stats()
            report = (
                prefill_autoscaling_stats(stats, rate)
                if role == "prefill"
                else decode_autoscaling_stats(stats, r.itl.value, rate)
            )
            for name, value in report.items():
                out.setdefault(name, {})[r.replica_id] = value
        return out

    def tick(self) -> None:
        c = self.cluster
        now = c.loop.now
        for role, policy in self.policies.items():
            if policy is None:
                continue
            pool = c.app.pool(role)  # type: ignore[arg-type]
            live = [r for r in c.pools[role] if not r.draining]
            ctx = SimpleNamespace(
                aggregated_metrics=self.metrics(role),
                current_num_replicas=sum(r.ready for r in live),
                target_num_replicas=len(live),
                policy_state={},
            )
            wanted, _ = policy(ctx)
            wanted = min(max(wanted, pool.min_replicas), pool.max_replicas)
            self._apply(role, pool, live, wanted, now)
        c.timeline.append(
            (now, *(sum(not r.draining for r in c.pools[p]) for p in ROLES))  # type: ignore[arg-type]
        )
        if c.open_requests > 0:
            c.loop.after(c.s.autoscale_period_s, self.tick)

    def _apply(self, role: str, pool: Any, live: list[SimReplica], wanted: int, now: float) -> None:
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
            c.start_replica(role, ready_in=c.s.replica_startup_s)  # type: ignore[arg-type]
        for replica in sorted(live, key=lambda r: r.ongoing)[: max(0, len(live) - wanted)]:
            replica.draining = True
            if replica.ongoing == 0 and replica.engine.idle:
                c.retire(replica)
