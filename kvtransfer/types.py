"""Typed metadata that crosses process boundaries during a KV hand-off.

``KVLayout`` is the signature both sides must agree on before any byte moves; ``KVTarget``
is what the decode side hands to the prefill side (through the serving layer) so it knows
where to write; ``TransferResult`` is what each side reports when a transfer ends. All are
frozen pydantic models so they can ride inside the deployments' request/response messages.
This module never touches sockets or tensors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TransportName = Literal["shm", "torch_dist", "cuda_ipc"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KVLayout(_Frozen):
    """The shape of one engine's paged KV pool, minus the number of blocks.

    A tensor-parallel rank's pool holds only some of the model's KV heads: the global heads
    ``[kv_head_start, kv_head_start + num_kv_heads)`` of ``total_kv_heads``. With fewer KV
    heads than ranks the heads are replicated; only the copy with ``kv_head_replica == 0``
    (the canonical one) is ever sent. The defaults describe a single-rank pool."""

    model: str = Field(description="Model identity (name or path) the KV was computed with.")
    num_layers: int = Field(gt=0, description="Transformer layers in the pool.")
    num_kv_heads: int = Field(gt=0, description="KV heads per layer held by this pool.")
    head_dim: int = Field(gt=0, description="Dimension of one head.")
    block_size: int = Field(gt=0, description="Tokens per KV block.")
    num_planes: int = Field(
        default=2,
        ge=1,
        le=2,
        description="Planes per layer: 2 (keys, values), or 1 where one cached slot is "
        "read as both (multi-head latent attention).",
    )
    dtype: str = Field(description="torch dtype name of the pool, e.g. 'float32'.")
    kv_head_start: int = Field(
        default=0, ge=0, description="Global index of this pool's first KV head."
    )
    total_kv_heads: int | None = Field(
        default=None, gt=0, description="KV heads of the whole model; None = num_kv_heads."
    )
    kv_head_replica: int = Field(
        default=0,
        ge=0,
        description="0: this pool holds the canonical copy of its heads; >0: a replica "
        "(tensor parallelism over more ranks than KV heads), which never sends.",
    )
    tp_size: int = Field(default=1, gt=0, description="Ranks of the replica's TP group.")
    tp_rank: int = Field(default=0, ge=0, description="This pool's rank in its TP group.")
    kv_scales: tuple[float, ...] = Field(
        default=(),
        description="An int8 / float8 pool's scales, [num_layers, 2 (K, V), num_kv_heads] "
        "flattened: the values its blocks hold are multiplied by these; empty for a float "
        "pool. Both sides of a hand-off must hold the same.",
    )

    @model_validator(mode="after")
    def _heads_inside_the_model(self) -> KVLayout:
        if self.kv_head_start + self.num_kv_heads > self.heads_total:
            raise ValueError(
                f"kv heads: [{self.kv_head_start}, {self.kv_head_start + self.num_kv_heads}) "
                f"run past total_kv_heads={self.heads_total}"
            )
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank: {self.tp_rank} is not below tp_size={self.tp_size}")
        return self

    @property
    def heads_total(self) -> int:
        """KV heads of the whole model."""
        return self.num_kv_heads if self.total_kv_heads is None else self.total_kv_heads

    @property
    def kv_heads(self) -> range:
        """Global indices of the KV heads this pool holds."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

    @property
    def canonical_heads(self) -> range:
        """The heads this pool may send: all of its heads, or none for a replica copy."""
        return (
            self.kv_heads
            if self.kv_head_replica == 0
            else range(self.kv_head_start, self.kv_head_start)
        )

    def describe_heads(self) -> str:
        """'heads [a, b) of H (tp rank r/t[, replica k])' for error messages."""
        replica = f", replica {self.kv_head_replica}" if self.kv_head_replica else ""
        return (
            f"heads [{self.kv_head_start}, {self.kv_head_start + self.num_kv_heads}) of "
            f"{self.heads_total} (tp rank {self.tp_rank}/{self.tp_size}{replica})"
        )

    def mismatch(self, other: KVLayout) -> str | None:
        """A message naming every field both sides must agree on where ``self`` (local) and
        ``other`` (peer) differ. Head ranges and TP placement may differ (the heads are
        mapped rank to rank, see ``pdserve.kvtransfer.tp_plan``); the model's total heads
        may not, nor may a head range fall outside the model's heads."""
        diffs = []
        fields = ("model", "num_layers", "total_kv_heads", "head_dim", "block_size", "dtype")
        for name in (*fields, "num_planes"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if name == "total_kv_heads":
                mine, theirs = self.heads_total, other.heads_total
            if mine != theirs:
                diffs.append(f"{name}: local={mine!r} peer={theirs!r}")
        if not diffs:
            worst = _scale_mismatch(self.shared_head_scales(other), other.shared_head_scales(self))
            if worst is not None:
                diffs.append(f"kv_scales ({self.dtype}): {worst}")
        if not diffs:  # layouts built with model_construct skip the validator
            for side, layout in (("local", self), ("peer", other)):
                heads = layout.kv_heads
                if heads.start < 0 or heads.stop > layout.heads_total:
                    diffs.append(
                        f"kv heads: {side} holds [{heads.start}, {heads.stop}), outside the "
                        f"model's [0, {layout.heads_total}) (local {self.describe_heads()}; "
                        f"peer {other.describe_heads()})"
                    )
        return "; ".join(diffs) if diffs else None

    def shared_head_scales(self, other: KVLayout) -> tuple[float, ...]:
        """This pool's scales of the global KV heads it shares with ``other`` (layer, K/V,
        head order): what both sides of a hand-off must agree on. Empty for a float pool;
        all of them when a pool's scales do not match its heads (the lengths then differ)."""
        if len(self.kv_scales) != 2 * self.num_layers * self.num_kv_heads:
            return self.kv_scales
        lo = max(self.kv_head_start, other.kv_head_start)
        hi = min(self.kv_head_start + self.num_kv_heads, other.kv_head_start + other.num_kv_heads)
        first, count = lo - self.kv_head_start, max(hi - lo, 0)
        rows = len(self.kv_scales) // self.num_kv_heads  # one per layer and K/V
        return tuple(
            self.kv_scales[row * self.num_kv_heads + first + h]
            for row in range(rows)
            for h in range(count)
        )

    def block_bytes(self, num_heads: int | None = None) -> int:
        """Bytes of one block of one layer, every plane (K and V, or MLA's one), over
        ``num_heads`` heads (default: every head of this pool)."""
        heads = self.num_kv_heads if num_heads is None else num_heads
        elem = _dtype_size(self.dtype)
        return self.num_planes * self.block_size * heads * self.head_dim * elem


class KVTarget(_Frozen):
    """Where and under which credentials a prefill engine may write one request's KV."""

    transport: TransportName = Field(description="Transport the decode side offers.")
    address: str = Field(description="host:port of the decode side's control listener.")
    node_id: str = Field(description="Identity of the decode node (same node => zero copy).")
    request_id: str = Field(min_length=1, description="Request whose KV is expected.")
    block_ids: tuple[int, ...] = Field(description="Destination block ids, in prompt order.")
    first_block: int = Field(
        default=0,
        ge=0,
        description="Index among the prompt's blocks of the first one written: the decode "
        "side already holds the prompt's first ``first_block`` blocks (its prefix cache), "
        "so only the blocks from there on are sent (a delta hand-off).",
    )
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
    layer_messages: int = Field(
        default=0,
        ge=0,
        description="Layer messages sent (sender) / landed (receiver): one per layer per step "
        "that sent blocks, so a prompt sent in k chunks over L layers gives k * L.",
    )


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


# Scales computed by the same calibration on different devices may differ in their last
# bits; past this relative difference the two pools mean different values.
_SCALE_RTOL = 1e-3


def _scale_mismatch(mine: tuple[float, ...], theirs: tuple[float, ...]) -> str | None:
    """Where two pools' scales disagree (one line), or None when they agree."""
    if len(mine) != len(theirs):
        return f"local has {len(mine)} scales, peer {len(theirs)}"
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if abs(a - b) > _SCALE_RTOL * max(abs(a), abs(b)):
            return f"scale {i} local={a!r} peer={b!r} (the pools quantize differently)"
    return None


def _dtype_size(name: str) -> int:
    try:
        return _DTYPE_SIZES[name]
    except KeyError:
        raise ValueError(f"dtype: unsupported KV dtype {name!r}") from None
