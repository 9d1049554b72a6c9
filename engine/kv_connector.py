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
    """A prefill_only request whose prefill completes in the current step.

    ``block_ids`` is the request's block table in prompt order; ``num_tokens`` is the number
    of prompt tokens whose KV lives in those blocks (the last block may be partly filled).
    """

    request_id: str
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


@runtime_checkable
class KVConnector(Protocol):
    """What the engine calls on the prefill side, in this order, once per step.

    Side effects: ``register_kv_caches`` comes first, once, when the engine has allocated
    its pool (as in vLLM v1, the connector exists before the pool and learns it then);
    ``begin_step`` starts sends (the connector may read the blocks of the listed requests
    from ``layer_computed`` onwards); the engine does not free or reuse those blocks until
    the request id came back from ``end_step`` or ``poll_finished``.
    """

    def register_kv_caches(self, kv_cache: torch.Tensor, model_name: str) -> None:
        """The engine's KV pool ``[L, 2, N, B, Hkv, D]`` and the identity of the model that
        fills it (part of the layout both ends of a transfer must agree on)."""

    def begin_step(self, sends: list[PendingSend]) -> None:
        """Announce the requests whose prefill completes in this step (may be empty)."""

    def layer_computed(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        """Called by the model right after layer ``layer_idx``'s K/V were written. Cheap."""

    def end_step(self) -> list[str]:
        """Called after the forward pass; returns request ids whose sends are complete."""

    def poll_finished(self) -> list[str]:
        """Request ids whose sends completed since the last call (between steps)."""
