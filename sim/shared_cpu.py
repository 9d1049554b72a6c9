"""Engines that compute on the CPUs a local cluster's serving processes share.

On a small machine ``pdserve up`` pins each decode engine to CPUs of its own and leaves the
rest shared by every other thread: Ray's daemons, the proxy, the ingress, the decode
replica's own threads, and an engine that has no CPUs of its own (the 2-core disaggregated
config's prefill replica, niced so that serving stays responsive). Such an engine computes
only while the serving path leaves the shared CPUs idle, so each of its steps takes its
profiled time divided by the share left: ``1 - background - s_per_request x arrival rate /
num_cpus``, the serving path's CPU demand being proportional to the requests it carries
(measured per request by ``sim.cpu_account`` in ``sim.validate measure``).

An engine bound to CPUs of its own may add niced helper threads on the shared CPUs for big
steps (the 2-core colocated config's decode engine): they add the same share of a CPU each
(``HelperThreadsCost``). What this leaves out: a nice-0 engine on the shared CPUs would get
a fair share rather than the remainder (it is modelled as niced), and jobs outside the
cluster (threads free to run on every CPU) take from every engine. Pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.deployments.config import AppConfig, PoolRole
from pdserve.deployments.load import RateMeter
from pdserve.sim.config import HelperThreads, SharedCpuSettings
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


class HelperThreadsCost:
    """``cost`` (profiled with the engine's base threads alone) for an engine whose steps of
    at least ``min_tokens`` tokens add helper threads on the shared CPUs. The linears hand
    out work dynamically, so each helper adds the share of a CPU the serving path leaves:
    such a step takes its time x base / (base + helpers x share). Ideal scaling: an upper
    bound on what the helpers add."""

    def __init__(self, cost: CostModel, load: SharedCpuLoad, helpers: HelperThreads) -> None:
        self.cost = cost
        self.load = load
        self.helpers = helpers
        self.kv_bytes_per_token = cost.kv_bytes_per_token
        self.kv_capacity_tokens = cost.kv_capacity_tokens
        self.num_layers = getattr(cost, "num_layers", 1)

    def step_s(self, tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: int) -> float:
        base = self.cost.step_s(tokens, prefill_attn, decode_seqs, decode_ctx)
        h = self.helpers
        if tokens < h.min_tokens:
            return base
        return base * h.base_threads / (h.base_threads + h.helper_threads * self.load.share())

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.cost.transfer_s(prompt_tokens)


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


def helpers_on_shared_cpus(app: AppConfig, plan: dict) -> tuple[HelperThreads, ...]:
    """The pools whose engines have CPUs of their own and helper threads on the shared ones
    (the 2-core colocated config's decode pool)."""
    out = []
    for role in _pools_in_use(app):
        own, cpu = plan[f"{role}_engine_cpus"], app.pool(role).cpu
        if own and cpu.helper_threads and plan["shared_cpus"] and app.pool_device(role) == "cpu":
            base = max(1, min(int(app.pool(role).num_cpus), len(own)))
            out.append(HelperThreads(role=role, base_threads=base,
                                     helper_threads=cpu.helper_threads,
                                     min_tokens=cpu.helper_min_tokens))  # fmt: skip
    return tuple(out)


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
    helpers = helpers_on_shared_cpus(app, plan)
    if not roles and not helpers:
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
        helpers=helpers,
        num_cpus=len(shared),
        s_per_request=sum(costs) / len(costs),
        background=min(0.95, sum(backgrounds) / len(backgrounds)),
    )
