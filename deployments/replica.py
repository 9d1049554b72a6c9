"""Per-replica helpers shared by the prefill and decode servers: identity, torch threads and
engine CPUs, the KV-transfer metrics observer, and the integrity report both servers return.

Everything here also works outside Ray (tests construct servers directly).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.deployments.config import PoolConfig
from pdserve.deployments.metrics import ServingMetrics
from pdserve.engine.affinity import ENGINE_CPUS_ENV, check_cpus_exist, parse_cpu_list
from pdserve.kvtransfer.types import TransferResult


class IntegrityReport(BaseModel):
    """What a server still holds; after all requests ended every count should be idle."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["prefill", "decode"]
    node_id: str | None = Field(description="Ray node id of the replica (None outside Ray).")
    num_unfinished: int = Field(description="Requests the engine still tracks.")
    num_free_blocks: int = Field(description="KV blocks free or evictable.")
    num_total_blocks: int
    pending_transfers: list[str] = Field(description="KV transfers still open.")
    num_streams: int = Field(default=0, description="Client streams still open (decode).")
    engine_cpus: list[int] = Field(
        default_factory=list, description="CPUs the engine thread is bound to; [] = unbound."
    )
    helper_cpus: list[int] = Field(
        default_factory=list, description="CPUs of the engine's helper threads; [] = none."
    )

    @property
    def idle(self) -> bool:
        return (
            self.num_unfinished == 0
            and self.num_free_blocks == self.num_total_blocks
            and not self.pending_transfers
            and self.num_streams == 0
        )


def engine_cpus(cpu_bind: str, environ: Mapping[str, str] = os.environ) -> tuple[int, ...]:
    """The CPUs a replica's engine thread binds to under the pool's ``cpu_bind``; () = none.

    'auto' takes the node's reservation (``$PDSERVE_ENGINE_CPUS``), an explicit list is used
    as given; either must name CPUs this machine has (ValueError otherwise).
    """
    if cpu_bind == "none":
        return ()
    if cpu_bind == "auto":
        text = environ.get(ENGINE_CPUS_ENV, "").strip()
        what = f"${ENGINE_CPUS_ENV}={text!r}"
    else:
        text, what = cpu_bind, f"cpu_bind {cpu_bind!r}"
    if not text:
        return ()
    cpus = parse_cpu_list(text)
    check_cpus_exist(cpus, what)
    return cpus


def set_torch_threads(num_cpus: float, bound_cpus: tuple[int, ...] = ()) -> int:
    """Give torch as many intra-op threads as the replica has CPUs (at least one, and no
    more than the CPUs its engine is bound to): unpinned replicas on a small machine would
    otherwise oversubscribe each other."""
    import torch

    threads = max(1, int(num_cpus))
    if bound_cpus:
        threads = min(threads, len(bound_cpus))
    torch.set_num_threads(threads)
    return threads


def configure_replica_cpus(pool: PoolConfig) -> tuple[int, ...]:
    """A replica's CPU settings from its pool: torch threads, niceness, and the CPUs its
    engine thread is to bind to (returned; the engine binds its own thread)."""
    cpus = engine_cpus(pool.cpu_bind)
    set_torch_threads(pool.num_cpus, cpus)
    lower_cpu_priority(pool.nice)
    return cpus


def lower_cpu_priority(nice: int) -> int:
    """Raise every thread of this process to at least niceness ``nice``; returns how many
    threads were changed.

    On Linux niceness is per thread and a new thread inherits its creator's, so this covers
    the threads that exist now and, through them, the engine and OpenMP threads started
    later. Only ever lowers priority (which needs no privileges).
    """
    if nice <= 0:
        return 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the whole process
        tids = [0]
    changed = 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:  # the thread ended meanwhile
            continue
    return changed


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except ImportError:  # pragma: no cover
        return False


def replica_name() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return f"local-{os.getpid()}"


def replica_node_id() -> str | None:
    if not _in_ray_worker():
        return None
    import ray

    return ray.get_runtime_context().get_node_id()


def replica_actor_name() -> str | None:
    """This replica's Ray actor name (namespace "serve"), None outside Ray."""
    if not _in_ray_worker():
        return None
    import ray

    return ray.get_runtime_context().get_actor_name()


def transfer_host(configured: str | None) -> str:
    """Address the KV listener binds to: configured, else this Ray node's address."""
    if configured:
        return configured
    if _in_ray_worker():
        import ray

        return ray.util.get_node_ip_address()
    return "127.0.0.1"


class TransferMetricsObserver:
    """kvtransfer observer exporting pdserve:kv_transfer_{seconds,bytes,failures}; also keeps
    totals for the server's counters. Called from transfer threads, hence the lock."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()
        self.bytes = 0
        self.transfers = 0
        self.failures = 0

    def on_transfer(self, side: str, result: TransferResult) -> None:
        with self._lock:
            self.transfers += 1
            self.bytes += result.bytes
            self.failures += 0 if result.ok else 1
        if result.bytes:
            self.metrics.kv_transfer_bytes.inc(result.bytes)
        self.metrics.kv_transfer_seconds.observe(result.seconds)
        if not result.ok:
            self.metrics.kv_transfer_failures.inc()
