"""A tensor-parallel engine's ranks: rank 0 (this process) schedules, samples and drives
ranks 1..tp-1, which each hold their shard of the weights and KV heads and run every step.

Rank 0's ``TPExecutor`` stands where the single-device ``ModelRunner`` stands for
``LLMEngine``: each step it sends the scheduler's plan to every worker, runs its own shard
(the layers' all-reduces and the logits' all-gather meet the workers' in the TP group),
samples, then collects the workers' replies. The plan is small (token ids and block tables),
as in vLLM's multiprocessing executor; the tensors stay on the ranks.

Workers are started one of two ways (``EngineConfig.tp_workers``):
- ``mp``: child processes (spawned) talking over pipes; a worker exits when its pipe
  closes, so nothing outlives rank 0;
- ``ray``: Ray actors in bundles 1..tp-1 of the caller's placement group (a Serve replica
  deployed with ``placement_group_bundles``, STRICT_PACK on one node); Ray ends them with
  the replica that owns them.

A worker that dies fails the step with ``TPWorkerError`` (the engine loop stops, the
replica's health check fails and Serve replaces it); the survivors' collectives fail when
the group's connection closes or times out, so no rank hangs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.parallel import TPGroup, join_group, store_master
from pdserve.engine.sampler import SampledToken
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.tp_worker import (
    GROUP_TIMEOUT_S,
    START_TIMEOUT_S,
    KVAgentFactory,
    RankPlace,
    TPWorkerError,
    WorkerSpec,
    start_workers,
)
from pdserve.engine.window_kv import WindowLayout

__all__ = ["TPConnector", "TPExecutor", "TPWorkerError", "checked_tp_connector"]

logger = logging.getLogger(__name__)


@runtime_checkable
class TPConnector(KVConnector, Protocol):
    """Rank 0's KV connector under tensor parallelism: it speaks for every rank (the
    workers' halves are their ``RankKVAgent``s, reached through the executor it is
    attached to)."""

    def attach(self, executor: TPExecutor) -> None:
        """Called once by the executor (to poll the workers between steps)."""

    def step_meta(self) -> Any:
        """What the workers' agents get with the next step."""

    def worker_reports(self, reports: list[Any]) -> None:
        """The workers' ``step_report`` answers, rank order."""


def checked_tp_connector(connector: KVConnector | None) -> TPConnector | None:
    """``connector`` as a TPConnector; a TypeError naming its type when it cannot speak
    for the other ranks (it lacks ``attach`` / ``step_meta`` / ``worker_reports``)."""
    if connector is None or isinstance(connector, TPConnector):
        return connector
    kind = type(connector).__name__
    raise TypeError(f"kv_connector: tensor parallelism needs a TPConnector, got {kind}")


# ---- rank 0 ---------------------------------------------------------------------------------


class TPExecutor:
    """Rank 0 of a tensor-parallel engine: the ``ModelRunner`` of its shard plus the workers.

    It offers what ``LLMEngine`` needs of a model runner; every call that touches the
    model or the pool runs on all ranks."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        kv_cache_allocator: Any = None,
        kv_connector: TPConnector | None = None,
        runtime_settings: Any = None,
        kv_cache_allocator_factory: Callable[[], Any] | None = None,
        kv_agent_factory: KVAgentFactory | None = None,
    ) -> None:
        from pdserve.engine.model_runner import ModelRunner, resolve_device

        size = config.tensor_parallel_size
        if size < 2:
            raise ValueError(f"TPExecutor needs tensor_parallel_size >= 2, got {size}")
        if kv_connector is not None and kv_agent_factory is None:
            raise ValueError("a KV connector on rank 0 needs kv_agent_factory for the others")
        host = "127.0.0.1"  # every rank of a replica is on its node (STRICT_PACK)
        store = store_master(host, size, GROUP_TIMEOUT_S)
        specs = [
            WorkerSpec(
                config=config,
                rank=rank,
                store_address=(host, store.port),
                runtime_settings=runtime_settings,
                kv_cache_allocator_factory=kv_cache_allocator_factory,
                kv_agent_factory=kv_agent_factory,
            )
            for rank in range(1, size)
        ]
        self.workers = start_workers(specs, config.tp_workers)
        try:
            device = resolve_device(config.device, 0)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            tp = join_group(0, size, (host, store.port), device, GROUP_TIMEOUT_S, store=store)
            self.runner = ModelRunner(
                config,
                kv_cache_allocator=kv_cache_allocator,
                # Only a connector that reads KV per layer is hooked into the forward pass.
                kv_connector=kv_connector
                if kv_connector is not None and kv_connector.saves_kv_layers
                else None,
                runtime_settings=runtime_settings,
                tp=tp,
            )
            for w in self.workers:
                w.result(START_TIMEOUT_S)  # started: shard loaded, group joined
        except BaseException:
            self.shutdown()
            raise
        self._store = store  # rank 0 hosts the rendezvous for the group's lifetime
        self.kv_connector = kv_connector
        self.config = config
        # What LLMEngine and the serving layer read of a model runner.
        self.runtime = self.runner.runtime
        self.model_config = self.runner.model_config
        self.tokenizer = self.runner.tokenizer
        self.sampler = self.runner.sampler
        self.device = self.runner.device
        self.max_model_len = self.runner.max_model_len
        self.tp: TPGroup = self.runner.tp
        if kv_connector is not None:
            kv_connector.attach(self)

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self.runner.kv_cache

    @property
    def window_layout(self) -> WindowLayout | None:
        """Rank 0's window pool plan; every rank plans the same one (its own heads)."""
        return self.runner.window_layout

    @property
    def window_kv_cache(self) -> torch.Tensor | None:
        return self.runner.window_kv_cache

    @property
    def kv_scales(self) -> torch.Tensor | None:
        """Rank 0's ``[L, 2, H]`` KV scales (its heads' share; every rank computed its own
        in the same calibration pass), None for a float pool."""
        return self.runner.kv_scales

    def pool_kv_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rank 0's scales split by pool (``ModelRunner.pool_kv_scales``)."""
        return self.runner.pool_kv_scales()

    def rank_kv_scales(self) -> list[torch.Tensor | None]:
        """Every rank's KV scales (CPU), rank order."""
        own = self.runner.kv_scales
        return [None if own is None else own.cpu(), *self._all("kv_scales")]

    def _all(self, method: str, *args: Any, timeout: float = GROUP_TIMEOUT_S) -> list[Any]:
        for w in self.workers:
            w.submit(method, *args)
        return [w.result(timeout) for w in self.workers]

    def profile_num_blocks(self) -> int:
        """The fewest blocks any rank can afford (every rank holds the same block ids)."""
        for w in self.workers:
            w.submit("profile_num_blocks")
        own = self.runner.profile_num_blocks()
        return min([own, *(w.result(GROUP_TIMEOUT_S) for w in self.workers)])

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        layouts = self._all("allocate_kv_cache", num_blocks, self.model_config.kv_identity)
        if any(layout != self.runner.window_layout for layout in layouts):
            raise RuntimeError(
                f"the ranks planned different window pools: rank 0 {self.runner.window_layout}, "
                f"the others {layouts}"
            )
        return self.runner.allocate_kv_cache(num_blocks)

    def warm_up(self) -> int:
        for w in self.workers:
            w.submit("warm_up")
        calls = self.runner.warm_up()
        for w in self.workers:
            w.result(START_TIMEOUT_S)
        return calls

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        connector = self.kv_connector
        meta = connector.step_meta() if connector is not None else None
        for w in self.workers:
            w.submit("execute", out, meta)
        try:
            sampled = self.runner.execute(out)
        finally:
            # Every worker's reply is read even when this rank failed: a worker's error
            # (or death) is the cause worth reporting, and the pipes stay in step.
            reports = [w.result(GROUP_TIMEOUT_S) for w in self.workers]
        if connector is not None:
            connector.worker_reports(reports)
        return sampled

    def run_sends_only(self, sends: list[Any]) -> None:
        """A step without a forward pass that still carries sends (cancels of requests
        that left mid-prefill): the workers' connectors get them too (rank 0's is called
        by the engine)."""
        connector = self.kv_connector
        if connector is None:
            return
        connector.worker_reports(self._all("sends_only", sends, connector.step_meta()))

    def poll_workers(self, meta: Any) -> list[Any]:
        """Between steps (on the engine's thread): every worker agent's report."""
        return self._all("poll", meta)

    def agent_call(self, rank: int, method: str, *args: Any, timeout: float | None = 60.0) -> Any:
        """``method`` of worker ``rank``'s KV agent, from any thread, beside the steps
        (``timeout`` None: no limit)."""
        if not 1 <= rank <= len(self.workers):
            raise ValueError(f"rank {rank}: workers are ranks 1..{len(self.workers)}")
        return self.workers[rank - 1].call_agent(method, args, timeout)

    def check_health(self) -> None:
        """TPWorkerError if a worker is gone (checked between steps, by the replica)."""
        for w in self.workers:
            w.check_alive()

    def worker_places(self) -> list[RankPlace]:
        """Where ranks 1.. run (from any thread)."""
        return [w.call_agent("where", (), 10.0) for w in self.workers]

    def shutdown(self) -> None:
        """Stop the workers (best effort: they may already be gone)."""
        for w in getattr(self, "workers", []):
            try:
                w.submit("shutdown")
                w.result(10.0)
            except TPWorkerError:
                pass
            w.close()
        self.workers = []
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.tp.abort()
