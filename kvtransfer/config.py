"""Configuration of the KV-transfer endpoints (both sides use the same model)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class KVTransferConfig(BaseModel):
    """How a KV sender or receiver talks to its peers.

    ``transport="auto"`` picks CUDA IPC for a CUDA pool on the same node, shared memory for a
    CPU pool on the same node (when the pool lives in a shared segment) and torch.distributed
    (NCCL for CUDA, gloo for CPU) otherwise.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    transport: Literal["auto", "shm", "torch_dist", "cuda_ipc"] = Field(
        default="auto", description="Transport to offer (receiver) or force (sender)."
    )
    host: str = Field(
        default="127.0.0.1",
        description="Cluster-internal address the control listener and gloo bind to.",
    )
    node_id: str | None = Field(
        default=None,
        description="Identity of this node; None derives it from hostname and boot id.",
    )
    connect_timeout_s: float = Field(
        default=10.0, gt=0, description="Bound on connecting to a peer (incl. group setup)."
    )
    cancel_fence_s: float = Field(
        default=1.0,
        gt=0,
        description="How long a cancelling receiver waits for the sender to confirm it "
        "stopped writing into shared blocks.",
    )
    default_deadline_s: float = Field(
        default=30.0, gt=0, description="Deadline used by expect() when none is given."
    )
