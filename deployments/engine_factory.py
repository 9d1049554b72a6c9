"""How a replica gets its engine: an injectable factory (tests may pass their own).

``EngineFactory`` takes the replica's ``EngineConfig`` plus its role hooks (KV allocator,
KV connector, the settings of the engine's device runtime) and returns an
``AsyncLLMEngine``-compatible object. The default builds the real engine. Factories are
sent to replicas by value (cloudpickle), so a test can define one in the test module and
run a real Serve app with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.deployments.config import AppConfig, PoolConfig, PoolRole
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import KVConnector
from pdserve.kernels.cpu.cpus import ENGINE_CPUS_ENV, RuntimeSettings

if TYPE_CHECKING:
    from pdserve.engine.async_engine import AsyncLLMEngine


@dataclass(frozen=True)
class EngineHooks:
    """Role-specific pieces injected into the engine."""

    role: PoolRole
    kv_cache_allocator: Any = None  # KVCacheAllocator: the decode pool's shared-memory pool
    kv_connector: KVConnector | None = None  # the prefill side's KV sender
    # Tensor parallel: builds the KV agent (sender / receiver) of each rank 1.. on that rank.
    kv_agent_factory: Any = None
    runtime: RuntimeSettings | None = None  # what the replica asks of the device runtime


EngineFactory = Callable[[EngineConfig, EngineHooks], Any]


def runtime_settings(pool: PoolConfig, environ: Mapping[str, str] = os.environ) -> RuntimeSettings:
    """What a pool's replica asks of its engine's device runtime: torch threads from
    ``num_cpus``, the ``cpu:`` section, and the node's engine-CPU reservation (read here,
    once; the runtime resolves and applies it, or ignores it on a GPU)."""
    cpu = pool.cpu
    return RuntimeSettings(
        num_cpus=pool.num_cpus,
        nice=cpu.nice,
        engine_nice=cpu.engine_nice,
        cpu_bind=cpu.cpu_bind,
        node_engine_cpus=environ.get(ENGINE_CPUS_ENV, ""),
        helper_threads=cpu.helper_threads,
        helper_min_tokens=cpu.helper_min_tokens,
    )


def pool_hooks(cfg: AppConfig, role: PoolRole, **hooks: Any) -> EngineHooks:
    """A pool's hooks: its role's pieces (``hooks``) plus its device runtime's settings."""
    return EngineHooks(role, runtime=runtime_settings(cfg.pool(role)), **hooks)


def default_engine_factory(config: EngineConfig, hooks: EngineHooks) -> AsyncLLMEngine:
    from pdserve.engine.async_engine import AsyncLLMEngine
    from pdserve.engine.llm_engine import LLMEngine

    llm = LLMEngine(
        config,
        kv_cache_allocator=hooks.kv_cache_allocator,
        kv_connector=hooks.kv_connector,
        runtime_settings=hooks.runtime,
        kv_agent_factory=hooks.kv_agent_factory,
    )
    return AsyncLLMEngine(llm)


def require_device(cfg: AppConfig, role: PoolRole, cuda_available: bool | None = None) -> str:
    """The engine device of this replica; a pool that asks for CUDA and was given no GPU
    fails its start here, with the reason, instead of running on the CPU."""
    device = cfg.pool_device(role)
    if device != "cuda":
        return device
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        tp = cfg.pool(role).tensor_parallel_size
        if tp == 1:
            asked = f"{cfg.gpus_per_replica(role):g} GPU per replica"
        else:
            asked = f"{cfg.gpus_per_rank(role):g} GPU per rank, {tp} ranks per replica"
        raise RuntimeError(
            f"{role} replica: the pool runs on CUDA ({asked}) but this process sees no GPU "
            f"(CUDA_VISIBLE_DEVICES={visible!r}); check the node's GPUs and the pool's "
            "num_gpus, or set model.device: cpu"
        )
    return device


def engine_config(cfg: AppConfig, role: PoolRole, model_dir: str) -> EngineConfig:
    """The ``EngineConfig`` of one pool's replicas (checks the replica got its GPU). Its
    ``tensor_parallel_size`` is the pool's; ``tp_workers`` stays 'auto': inside a Serve
    replica's placement group (``app.placement_options``) ranks 1.. become Ray actors in
    bundles 1.., elsewhere (a profiler, a test) child processes."""
    pool = cfg.pool(role)
    limits = pool.engine
    return EngineConfig(
        model=model_dir,
        dtype=cfg.model.dtype,
        quantization=cfg.model.quantization,
        quantize_lm_head=cfg.model.quantize_lm_head,
        model_impl=cfg.model.impl,
        device=require_device(cfg, role),  # type: ignore[arg-type]
        seed=cfg.model.seed,
        block_size=limits.block_size,
        num_kv_blocks=limits.num_kv_blocks,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        max_num_seqs=limits.max_num_seqs,
        max_model_len=limits.max_model_len,
        enable_prefix_caching=limits.enable_prefix_caching,
        cuda_graphs=limits.cuda_graphs,
        kv_cache_dtype=limits.kv_cache_dtype,
        tensor_parallel_size=pool.tensor_parallel_size,
    )
