"""The shape of a local pdserve cluster: which Ray nodes, their labels and their CPU shares.

A local cluster mirrors the Kubernetes one (``helm/pdserve``): a head node that runs the Serve
controller, the proxy and the ingress, a node labelled ``pdserve.io/pool=prefill`` and a node
labelled ``pdserve.io/pool=decode``. Node CPUs are Ray's logical CPUs; the replicas of each
pool ask for ``num_cpus`` and size torch's threads from it, so the pool nodes split the
machine's cores between them and the head gets none by default: the controller, the proxy and
the ingress ask for 0 CPUs (``AppConfig.ingress_num_cpus``) and spend their time waiting on
sockets, while an engine replica keeps its cores busy. Giving the head a logical CPU on a
2-core machine would only let something compute-bound land there and contend with the engines.

Logical CPUs only count; where processes actually run is the CPU plan (``CpuPlan``): with
``pin_cpus`` the decode engines get CPUs of their own (and the prefill engines too, when the
machine has enough), and everything else (the head's processes, the raylets, the replicas'
serving threads, prefill engines without CPUs of their own) runs on the remaining "shared"
CPUs. Each pool node tells its replicas their engine CPUs in ``$PDSERVE_ENGINE_CPUS``; a
replica binds only its engine thread there (``PoolConfig.cpu.cpu_bind``). On 2 cores: decode
engine on CPU 1, the rest on CPU 0. An engine that shares its core with the serving threads
waits behind their bursts every step (measurements in docs/cpu.md).

This module only describes; ``pdserve.cluster.local`` starts processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.deployments.config import POOL_LABEL_KEY
from pdserve.kernels.cpu.cpus import current_thread_cpus

NodeRole = Literal["head", "prefill", "decode"]
LOOPBACK_NODE_IP = "127.0.0.2"  # Ray rewrites 127.0.0.1 to the host's address; 127.0.0.2 stays.
MIB = 1024 * 1024
MIN_OBJECT_STORE_MIB = 80  # Ray refuses object stores below ~75 MiB.


class NodeSpec(BaseModel):
    """One Ray node of the local cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Short node name, also its temp-dir and log-file name.")
    role: NodeRole = Field(description="head, or the pool whose replicas the node hosts.")
    num_cpus: int = Field(ge=0, description="Logical CPUs the node offers to Ray.")
    num_gpus: int = Field(default=0, ge=0, description="GPUs the node offers to Ray.")
    gpu_ids: tuple[str, ...] | None = Field(
        default=None,
        description=(
            "The machine's GPUs (CUDA_VISIBLE_DEVICES entries) this node's raylet sees; "
            "None = whatever the machine shows it."
        ),
    )
    object_store_mib: int = Field(
        ge=MIN_OBJECT_STORE_MIB, description="Cap of the node's object store in /dev/shm (MiB)."
    )
    labels: dict[str, str] = Field(description="Ray node labels (``ray start --labels``).")
    cpus: tuple[int, ...] = Field(
        default=(), description="CPUs the node's processes start on; () = unrestricted."
    )
    engine_cpus: tuple[int, ...] = Field(
        default=(), description="CPUs reserved for the node's engine threads; () = none."
    )

    @property
    def object_store_bytes(self) -> int:
        return self.object_store_mib * MIB


class CpuPlan(BaseModel):
    """Where the processes of a pinned local cluster run (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shared_cpus: tuple[int, ...] = Field(description="CPUs of every non-engine thread.")
    prefill_engine_cpus: tuple[int, ...] = Field(
        description="CPUs of the prefill engines; () = they run on the shared CPUs."
    )
    decode_engine_cpus: tuple[int, ...] = Field(description="CPUs of the decode engines.")


class ClusterSpec(BaseModel):
    """Cluster-level settings of ``pdserve up``: what the CLI flags set (wraps no app config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_ip: str = Field(
        default=LOOPBACK_NODE_IP, description="Loopback address every node and proxy binds to."
    )
    head_cpus: int = Field(default=0, ge=0, description="Logical CPUs of the head node.")
    prefill_cpus: int = Field(ge=1, description="Logical CPUs of the prefill-pool node.")
    decode_cpus: int = Field(ge=1, description="Logical CPUs of the decode-pool node.")
    prefill_gpus: int = Field(
        default=0,
        ge=0,
        description=(
            "GPUs of the prefill-pool node. On a one-GPU machine both pool nodes may offer "
            "1: Ray then hands the replicas of each node device 0, so the pools share it."
        ),
    )
    decode_gpus: int = Field(default=0, ge=0, description="GPUs of the decode-pool node.")
    object_store_mib: int = Field(
        default=256,
        ge=MIN_OBJECT_STORE_MIB,
        description=(
            "Object store cap per node (MiB). Three of them plus the shared-memory KV pools "
            "must fit in /dev/shm."
        ),
    )
    dashboard: bool = Field(
        default=True,
        description="Start the Ray dashboard on the head (the state API and `status` need it).",
    )
    pin_cpus: bool = Field(
        default=True,
        description=(
            "Reserve CPUs for the engine threads (decode first) and start every other "
            "process on the remaining CPUs; needs 2+ CPUs and Linux."
        ),
    )
    direct_ingress: bool = Field(
        default=False,
        description=(
            "Serve's direct ingress: the ingress replica serves HTTP and gRPC itself, on "
            "ports of its own, with no Serve proxy in between, so requests and streamed "
            "tokens skip a hop through the proxy actor (one Python event loop that every "
            "request passes). Set on every node (Ray reads "
            "it when a process starts)."
        ),
    )
    machine_cpus: tuple[int, ...] | None = Field(
        default=None,
        description="CPUs the cluster may use; None = this process's CPU affinity.",
    )
    machine_gpus: tuple[str, ...] = Field(
        default=(),
        description=(
            "The machine's GPUs (indices or UUIDs, as CUDA_VISIBLE_DEVICES names them) the "
            "pool nodes split between them: prefill takes the first prefill_gpus, decode the "
            "next decode_gpus. () = no split (each node sees every GPU)."
        ),
    )

    @model_validator(mode="after")
    def _check_node_ip(self) -> ClusterSpec:
        if self.node_ip in ("127.0.0.1", "localhost"):
            raise ValueError(
                "node_ip: Ray rewrites 127.0.0.1/localhost to the host's network address; "
                "use another loopback address such as 127.0.0.2"
            )
        return self

    @model_validator(mode="after")
    def _check_gpus(self) -> ClusterSpec:
        wanted = self.prefill_gpus + self.decode_gpus
        if self.machine_gpus and wanted > len(self.machine_gpus):
            raise ValueError(
                f"prefill_gpus + decode_gpus = {wanted} but the machine shows "
                f"{len(self.machine_gpus)} GPU(s): {', '.join(self.machine_gpus)}"
            )
        return self

    @classmethod
    def for_this_machine(cls, *, gpus: list[str] | None = None, **overrides: object) -> ClusterSpec:
        """Split the machine's cores between the two pool nodes (at least one each), and
        its GPUs (``gpus``; None = detected) when the GPU counts are not given: half each
        (prefill gets the smaller half); one GPU is shared by both nodes."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        cores = cores or os.cpu_count() or 2
        prefill = max(1, cores // 2)
        defaults: dict[str, object] = {
            "prefill_cpus": prefill,
            "decode_cpus": max(1, cores - prefill),
        }
        gpus = visible_gpu_ids() if gpus is None else gpus
        explicit = {k: v for k, v in overrides.items() if v is not None}
        if len(gpus) == 1 and not {"prefill_gpus", "decode_gpus"} & set(explicit):
            # One GPU: both nodes offer it; each node's replica gets device 0.
            defaults.update(prefill_gpus=1, decode_gpus=1)
        elif len(gpus) > 1:
            n_prefill = explicit.get("prefill_gpus", len(gpus) // 2)
            if not isinstance(n_prefill, int):
                raise ValueError(f"prefill_gpus: expected an int, got {n_prefill!r}")
            n_decode = explicit.get("decode_gpus", len(gpus) - n_prefill)
            defaults.update(prefill_gpus=n_prefill, decode_gpus=n_decode, machine_gpus=tuple(gpus))
        defaults.update(explicit)
        return cls.model_validate(defaults)

    def gpu_split(self) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
        """The GPUs each pool node's raylet sees (prefill, decode); None = no restriction."""
        if not self.machine_gpus:
            return None, None
        n = self.prefill_gpus
        return self.machine_gpus[:n], self.machine_gpus[n : n + self.decode_gpus]

    def cpu_plan(self) -> CpuPlan | None:
        """Which CPUs the engines get and which the rest shares; None = no pinning.

        The decode engines get the last ``decode_cpus`` CPUs (at most all but one), the
        prefill engines the last ``prefill_cpus`` of the rest when that still leaves one
        shared CPU (else they share), and the shared CPUs are whatever remains. A pool with
        GPUs reserves nothing: its engine computes on the GPU, and its CPU work is serving.
        """
        cpus = sorted(self.machine_cpus if self.machine_cpus is not None else current_thread_cpus())
        if not self.pin_cpus or len(cpus) < 2 or not hasattr(os, "sched_setaffinity"):
            return None
        n_decode = 0 if self.decode_gpus else min(self.decode_cpus, len(cpus) - 1)
        decode, rest = cpus[len(cpus) - n_decode :], cpus[: len(cpus) - n_decode]
        n_prefill = 0 if self.prefill_gpus else min(self.prefill_cpus, len(rest) - 1)
        if n_decode == 0 and n_prefill <= 0:
            return None
        prefill = rest[len(rest) - n_prefill :] if n_prefill > 0 else []
        shared = rest[: len(rest) - len(prefill)]
        return CpuPlan(
            shared_cpus=tuple(shared),
            prefill_engine_cpus=tuple(prefill),
            decode_engine_cpus=tuple(decode),
        )

    def nodes(self) -> list[NodeSpec]:
        """Head first: the pool nodes join the head's GCS."""
        store = self.object_store_mib
        plan = self.cpu_plan()
        shared = plan.shared_cpus if plan else ()
        prefill_gpu_ids, decode_gpu_ids = self.gpu_split()
        return [
            NodeSpec(
                name="head",
                role="head",
                num_cpus=self.head_cpus,
                object_store_mib=store,
                labels={},
                cpus=shared,
            ),
            NodeSpec(
                name="prefill",
                role="prefill",
                num_cpus=self.prefill_cpus,
                num_gpus=self.prefill_gpus,
                gpu_ids=prefill_gpu_ids,
                object_store_mib=store,
                labels={POOL_LABEL_KEY: "prefill"},
                cpus=shared,
                engine_cpus=plan.prefill_engine_cpus if plan else (),
            ),
            NodeSpec(
                name="decode",
                role="decode",
                num_cpus=self.decode_cpus,
                num_gpus=self.decode_gpus,
                gpu_ids=decode_gpu_ids,
                object_store_mib=store,
                labels={POOL_LABEL_KEY: "decode"},
                cpus=shared,
                engine_cpus=plan.decode_engine_cpus if plan else (),
            ),
        ]


def visible_gpu_ids(environ: dict[str, str] | None = None) -> list[str]:
    """The machine's GPUs as CUDA_VISIBLE_DEVICES names them: that variable's entries when
    set, else the indices ``nvidia-smi -L`` lists (no CUDA context is created here)."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def format_labels(labels: dict[str, str]) -> str:
    """``ray start --labels`` syntax: ``k1=v1,k2=v2``."""
    for key, value in labels.items():
        if not key or any(c in key + value for c in ",="):
            raise ValueError(f"labels: {key!r}={value!r} may not be empty or contain ',' or '='")
    return ",".join(f"{k}={v}" for k, v in labels.items())
