"""Engine-side KV connector protocol for prefill/decode disaggregation.

A prefill-role engine is given a connector (kvtransfer's ``PrefillKVConnector``) that pushes
the KV blocks of each ``prefill_only`` request to its decode replica while the prefill is
computed. This module only defines the protocol and the small message the scheduler emits;
it never moves bytes and never imports torch at runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


@dataclass(frozen=True)
class PendingSend:
    """KV of a prefill_only request that the connector sends in the current step.

    A prompt prefilled in several chunks is sent chunk by chunk: every step that computes
    one of its chunks announces the blocks that become complete in that step, so their
    layers go out while the model computes them, not only after the last chunk.

    ``block_ids`` are this step's blocks, in prompt order; they are the request's blocks
    ``[block_offset, block_offset + len(block_ids))`` (earlier ones were sent in earlier
    steps). ``num_tokens`` is the number of prompt tokens of the whole request (its blocks:
    ``ceil(num_tokens / block_size)``; the last one may be partly filled). ``final`` marks
    the step whose chunk completes the prompt (it carries the last, maybe partial, block).
    ``cancel`` (no blocks) says the request left before its final chunk (aborted or
    preempted): its transfer must end now and the decode side be told it failed. The
    defaults describe a prompt sent whole in one step.
    """

    request_id: str
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    block_offset: int = 0
    final: bool = True
    cancel: bool = False

    @property
    def first(self) -> bool:
        """Whether this step opens the request's transfer (its first blocks)."""
        return self.block_offset == 0 and not self.cancel


@runtime_checkable
class KVConnector(Protocol):
    """What the engine calls on the prefill side, in this order, once per step.

    Side effects: ``register_kv_caches`` comes first, once, when the engine has allocated
    its pool (as in vLLM v1, the connector exists before the pool and learns it then);
    ``begin_step`` starts sends (the connector may read the blocks of the listed requests
    from ``layer_computed`` onwards); the engine does not free or reuse those blocks until
    the request id came back from ``end_step`` or ``poll_finished``: that happens once
    per request, after its final step's blocks were sent and confirmed, after its transfer
    failed, or after it was cancelled (then no read of its blocks is pending).
    """

    def register_kv_caches(self, kv_cache: torch.Tensor, model_name: str) -> None:
        """The engine's KV pool ``[L, 2, N, B, Hkv, D]`` and the identity of the model that
        fills it (part of the layout both ends of a transfer must agree on)."""

    def begin_step(self, sends: list[PendingSend]) -> None:
        """Announce this step's sends (may be empty): the blocks each prefill_only request
        completes in this step (its first step opens the transfer, its ``final`` one closes
        it) and the transfers to cancel."""

    def layer_computed(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        """Called by the model right after layer ``layer_idx``'s K/V were written. Cheap."""

    def end_step(self) -> list[str]:
        """Called after the forward pass; returns request ids whose sends are complete."""

    def poll_finished(self) -> list[str]:
        """Request ids whose sends completed since the last call (between steps)."""
