"""Typed metadata that crosses process boundaries during a KV hand-off.

``KVLayout`` is the signature both sides must agree on before any byte moves; ``KVTarget``
is what the decode side hands to the prefill side (through the serving layer) so it knows
where to write; ``TransferResult`` is what each side reports when a transfer ends. All are
frozen pydantic models so they can ride inside the deployments' request/response messages.
This module never touches sockets or tensors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TransportName = Literal["shm", "torch_dist", "cuda_ipc"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KVLayout(_Frozen):
    """The shape of one engine's paged KV pool, minus the number of blocks."""

    model: str = Field(description="Model identity (name or path) the KV was computed with.")
    num_layers: int = Field(gt=0, description="Transformer layers in the pool.")
    num_kv_heads: int = Field(gt=0, description="KV heads per layer.")
    head_dim: int = Field(gt=0, description="Dimension of one head.")
    block_size: int = Field(gt=0, description="Tokens per KV block.")
    dtype: str = Field(description="torch dtype name of the pool, e.g. 'float32'.")

    def mismatch(self, other: KVLayout) -> str | None:
        """A message naming every field where ``self`` (local) and ``other`` (peer) differ."""
        diffs = [
            f"{name}: local={getattr(self, name)!r} peer={getattr(other, name)!r}"
            for name in type(self).model_fields
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(diffs) if diffs else None

    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * _dtype_size(self.dtype)


class KVTarget(_Frozen):
    """Where and under which credentials a prefill engine may write one request's KV."""

    transport: TransportName = Field(description="Transport the decode side offers.")
    address: str = Field(description="host:port of the decode side's control listener.")
    node_id: str = Field(description="Identity of the decode node (same node => zero copy).")
    request_id: str = Field(min_length=1, description="Request whose KV is expected.")
    block_ids: tuple[int, ...] = Field(description="Destination block ids, in prompt order.")
    deadline: float = Field(description="Unix time after which the decode side gives up.")
    token: str = Field(min_length=16, description="Per-target random secret; writes need it.")
    layout: KVLayout = Field(description="Layout of the decode side's pool.")
    gpu: str | None = Field(
        default=None,
        description="UUID (else PCI bus id) of the GPU holding the decode pool; None for a "
        "CPU pool. CUDA IPC is used only if the sender sees this GPU.",
    )


class TransferResult(_Frozen):
    """Outcome of one request's transfer, as seen by the side that reports it."""

    request_id: str
    ok: bool
    bytes: int = Field(ge=0, description="Bytes of KV that landed (receiver) or were sent.")
    seconds: float = Field(ge=0, description="From open (sender) / expect (receiver) to end.")
    error: str | None = None
    transport: str = ""


class KVTransferError(RuntimeError):
    """A transfer failed (peer died, protocol violation, refused write)."""


class KVLayoutMismatchError(KVTransferError):
    """The two sides' pools differ; the message names both sides' values."""


class KVTransferRefusedError(KVTransferError):
    """The receiver refused a write (unknown request id, wrong token, bad block ids)."""


class KVTransferTimeoutError(KVTransferError, TimeoutError):
    """The transfer did not complete by its deadline."""


_DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def _dtype_size(name: str) -> int:
    try:
        return _DTYPE_SIZES[name]
    except KeyError:
        raise ValueError(f"dtype: unsupported KV dtype {name!r}") from None
