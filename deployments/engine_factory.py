"""How a replica gets its engine: an injectable factory (tests may pass their own).

``EngineFactory`` takes the replica's ``EngineConfig`` plus its role hooks (KV allocator,
KV connector) and returns an ``AsyncLLMEngine``-compatible object. The default builds the
real engine. Factories are sent to replicas by value (cloudpickle), so a test can define
one in the test module and run a real Serve app with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.deployments.config import AppConfig, PoolRole
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import KVConnector


@dataclass(frozen=True)
class EngineHooks:
    """Role-specific pieces injected into the engine."""

    role: PoolRole
    kv_cache_allocator: Any = None  # KVCacheAllocator: the decode pool's shared-memory pool
    kv_connector: KVConnector | None = None  # the prefill side's KV sender
    cpu_affinity: tuple[int, ...] = ()  # CPUs the engine thread binds to; () = unbound
    helper_threads: int = 0  # OpenMP helpers on the process's other CPUs (bound engines)
    helper_min_tokens: int = 32  # smallest step the helpers join


EngineFactory = Callable[[EngineConfig, EngineHooks], Any]


def pool_hooks(cfg: AppConfig, role: PoolRole, cpus: tuple[int, ...], **hooks: Any) -> EngineHooks:
    """A pool's hooks: its role's pieces (``hooks``) plus the CPU settings of its config."""
    pool = cfg.pool(role)
    return EngineHooks(
        role,
        cpu_affinity=cpus,
        helper_threads=pool.helper_threads,
        helper_min_tokens=pool.helper_min_tokens,
        **hooks,
    )


def default_engine_factory(config: EngineConfig, hooks: EngineHooks) -> Any:
    from pdserve.engine.async_engine import AsyncLLMEngine
    from pdserve.engine.llm_engine import LLMEngine

    llm = LLMEngine(
        config, kv_cache_allocator=hooks.kv_cache_allocator, kv_connector=hooks.kv_connector
    )
    return AsyncLLMEngine(
        llm,
        cpu_affinity=hooks.cpu_affinity,
        helper_threads=hooks.helper_threads,
        helper_min_tokens=hooks.helper_min_tokens,
    )


def engine_config(cfg: AppConfig, role: PoolRole, model_dir: str) -> EngineConfig:
    """The ``EngineConfig`` of one pool's replicas."""
    limits = cfg.pool(role).engine
    return EngineConfig(
        model=model_dir,
        dtype=cfg.model.dtype,
        device=cfg.model.device,
        seed=cfg.model.seed,
        block_size=limits.block_size,
        num_kv_blocks=limits.num_kv_blocks,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        max_num_seqs=limits.max_num_seqs,
        max_model_len=limits.max_model_len,
        enable_prefix_caching=limits.enable_prefix_caching,
    )
