"""Per-replica helpers shared by the prefill and decode servers: identity, the KV-transfer
metrics observer, and the integrity report both servers return (with where the engine's
runtime computes).

Everything here also works outside Ray (tests construct servers directly).
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.deployments.metrics import ServingMetrics
from pdserve.kernels.cpu.cpus import RuntimeInfo
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
    num_window_free_blocks: int = Field(
        default=0, description="Window pool blocks free or evictable (0 = no window pool)."
    )
    num_window_total_blocks: int = Field(
        default=0,
        description="Blocks of the window layers' own pool (engine/window_kv.py); 0 = none.",
    )
    num_streams: int = Field(default=0, description="Client streams still open (decode).")
    engine_cpus: list[int] = Field(
        default_factory=list, description="CPUs the engine thread is bound to; [] = unbound."
    )
    helper_cpus: list[int] = Field(
        default_factory=list, description="CPUs of the engine's helper threads; [] = none."
    )
    tp_ranks: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Tensor parallel: rank, pid and Ray node id of ranks 1.. ([] at TP=1).",
    )

    @property
    def idle(self) -> bool:
        return (
            self.num_unfinished == 0
            and self.num_free_blocks == self.num_total_blocks
            and self.num_window_free_blocks == self.num_window_total_blocks
            and not self.pending_transfers
            and self.num_streams == 0
        )


def runtime_report(engine: Any) -> dict[str, Any]:
    """The integrity report's ``engine_cpus``/``helper_cpus`` from the engine's runtime
    (test doubles without a runtime report none) and where its other TP ranks run."""
    describe = getattr(engine, "describe_runtime", None)
    info = describe() if describe is not None else RuntimeInfo()
    places = getattr(engine, "worker_places", None)
    ranks = [asdict(p) for p in places()] if places is not None else []
    return {
        "engine_cpus": list(info.engine_cpus),
        "helper_cpus": list(info.helper_cpus),
        "tp_ranks": ranks,
    }


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
