"""Engines that compute on the CPUs a local cluster's serving processes share.

On a small machine ``pdserve up`` pins each decode engine to CPUs of its own and leaves the
rest shared by every other thread: Ray's daemons, the proxy, the ingress, the decode
replica's own threads, and an engine that has no CPUs of its own (the 2-core disaggregated
config's prefill replica, niced so that serving stays responsive). Such an engine computes
only while the serving path leaves the shared CPUs idle, so each of its steps takes its
profiled time divided by the share left: ``1 - background - s_per_request x arrival rate /
num_cpus``, the serving path's CPU demand being proportional to the requests it carries
(measured per request by ``sim.cpu_account`` in ``sim.validate measure``).

What this leaves out: a nice-0 engine on the shared CPUs would get a fair share rather than
the remainder (it is modelled as niced); jobs outside the cluster (threads free to run on
every CPU) take from every engine; and the helper threads a bound engine may add on the
shared CPUs (the 2-core colocated config's) are not modelled: the profile is measured
without them (a standalone engine has no CPUs of its own to bind), and on a quiet machine
the colocated cluster's TTFT came out only 10-20% under that profile's prediction, far
from what a helper at the CPU share left (ideal scaling) would add. Pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.deployments.config import AppConfig, PoolRole
from pdserve.deployments.load import RateMeter
from pdserve.sim.config import SharedCpuSettings
from pdserve.sim.cost import CostModel
from pdserve.sim.cpu_account import serving_cpu_s

# Never model an engine as stopped outright: the kernel still hands a niced thread a sliver
# (about 1.5 % of a CPU at nice 19 against nice 0), and a zero share would stall the run.
MIN_SHARE = 0.02


class SharedCpuLoad:
    """The serving path's load on the shared CPUs, from the requests arriving."""

    def __init__(self, settings: SharedCpuSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self._arrivals = RateMeter(window_s=settings.window_s, clock=clock)

    def arrived(self) -> None:
        self._arrivals.add(1)

    def share(self) -> float:
        """Fraction of the shared CPUs left to an engine computing on them."""
        s = self.settings
        busy = s.background + s.s_per_request * self._arrivals.rate() / s.num_cpus
        return max(MIN_SHARE, 1.0 - busy)


class SharedCpuCost:
    """``cost`` for an engine on the shared CPUs: each step takes its time / ``share``."""

    def __init__(self, cost: CostModel, load: SharedCpuLoad) -> None:
        self.cost = cost
        self.load = load
        self.kv_bytes_per_token = cost.kv_bytes_per_token
        self.kv_capacity_tokens = cost.kv_capacity_tokens
        self.num_layers = getattr(cost, "num_layers", 1)

    def step_s(self, tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: int) -> float:
        base = self.cost.step_s(tokens, prefill_attn, decode_seqs, decode_ctx)
        return base / self.load.share()

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.cost.transfer_s(prompt_tokens)


def engines_on_shared_cpus(app: AppConfig, plan: dict) -> tuple[PoolRole, ...]:
    """The pools whose CPU engines the cluster's CPU plan (``CpuPlan.model_dump()``) leaves
    on the shared CPUs."""
    return tuple(
        role
        for role in _pools_in_use(app)
        if app.pool_device(role) == "cpu" and not plan[f"{role}_engine_cpus"]
    )


def _pools_in_use(app: AppConfig) -> tuple[PoolRole, ...]:
    colocated = app.prefill.max_replicas == 0 or app.policy.mode == "always_local"
    return ("decode",) if colocated else ("prefill", "decode")


def measured_settings(app: AppConfig, runs: list[tuple[dict, int]]) -> SharedCpuSettings | None:
    """``SharedCpuSettings`` from ``sim.validate measure``'s ``cpu.json`` of runs of ``app``
    (each with its number of requests): the daemons' share from the idle spell, the serving
    path's CPU seconds per request averaged over the runs; None when no engine of ``app``
    computes on the shared CPUs (or nothing was measured)."""
    runs = [(cpu, n) for cpu, n in runs if cpu.get("plan") and n > 0]
    if not runs:
        return None
    plan = runs[0][0]["plan"]
    roles = engines_on_shared_cpus(app, plan)
    if not roles:
        return None
    shared = tuple(plan["shared_cpus"])
    backgrounds, costs = [], []
    for cpu, n in runs:
        idle, run = cpu["idle"], cpu["run"]
        background = serving_cpu_s(idle, shared) / idle["wall_s"] / len(shared)
        serving = serving_cpu_s(run, shared) - background * len(shared) * run["wall_s"]
        backgrounds.append(background)
        costs.append(max(0.0, serving) / n)
    return SharedCpuSettings(
        roles=roles,
        num_cpus=len(shared),
        s_per_request=sum(costs) / len(costs),
        background=min(0.95, sum(backgrounds) / len(backgrounds)),
    )
