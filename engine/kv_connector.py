"""Engine-side KV connector protocol for prefill/decode disaggregation.

As in vLLM v1, a connector has two halves and one object serves both roles:

- the **scheduler half** (``KVConnectorScheduler``) answers the scheduler's questions about
  a request whose prompt KV comes from elsewhere: how many prompt tokens are available
  externally beyond those computed here, which blocks were reserved to receive them, and
  that the request left the engine;
- the **worker half** (``KVConnectorWorker``) moves bytes around the forward pass: it learns
  the KV pool once allocated, starts the step's sends (or loads), is told as each layer's
  K/V is written, and reports which requests' transfers completed.

A prefill-role engine is given kvtransfer's ``PrefillKVConnector`` (its worker half pushes
each ``prefill_only`` request's blocks to the decode replica while the prefill is
computed); a decode-role engine kvtransfer's ``DecodeKVConnector`` (its scheduler half
reserves blocks for the incoming prompt, its worker half receives into them). The serving
layer reaches the engine only through the connector and the engine's public methods.

This module only defines the protocols and the small message the scheduler emits; it never
moves bytes and never imports torch at runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    # With a window pool (``WindowKVConnector``): the window table's entries of the same
    # blocks (``NULL_BLOCK`` where the window no longer reaches); None without one.
    window_block_ids: list[int] | None = None

    @property
    def first(self) -> bool:
        """Whether this step opens the request's transfer (its first blocks)."""
        return self.block_offset == 0 and not self.cancel


@runtime_checkable
class KVConnectorScheduler(Protocol):
    """The scheduler half: called on the engine's thread, never touches tensors.

    Only requests whose prompt KV is loaded from another engine (decode role) reach it;
    a connector that loads nothing answers 0 and keeps no state.
    """

    def get_num_new_matched_tokens(
        self, request_id: str, num_prompt_tokens: int, num_computed_tokens: int
    ) -> int:
        """Prompt tokens past the ``num_computed_tokens`` already available in this engine
        (its prefix cache) whose KV the connector will load from elsewhere; 0 when the
        engine computes the rest of the prompt itself. No side effect."""

    def update_state_after_alloc(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        """The engine reserved ``block_ids`` (the request's whole block table, prompt order)
        and will keep them until ``request_finished``; the KV of prompt tokens
        ``[num_computed_tokens, num_computed_tokens + num_external_tokens)`` is to be
        written into them by the connector. Side effect: the connector records where the
        incoming KV goes."""

    def request_finished(self, request_id: str) -> None:
        """A request given to ``update_state_after_alloc`` left the engine (finished or
        aborted); its blocks are about to be freed. Side effect: the connector forgets
        it. Whoever drives the load must have stopped every write into the blocks before
        the request is finished (``DecodeKVConnector.cancel`` does)."""


@runtime_checkable
class KVConnectorWorker(Protocol):
    """The worker half, called around each forward pass in this order.

    Side effects: ``register_kv_caches`` comes first, once, when the engine has allocated
    its pool (as in vLLM v1, the connector exists before the pool and learns it then);
    ``begin_step`` starts sends (the connector may read the blocks of the listed requests
    from ``layer_computed`` onwards); the engine does not free or reuse those blocks until
    the request id came back from ``end_step`` or ``poll_finished``: that happens once
    per request, after its final step's blocks were sent and confirmed, after its transfer
    failed, or after it was cancelled (then no read of its blocks is pending).

    ``saves_kv_layers`` says whether the connector reads KV layer by layer during the
    forward pass; when False the engine does not hook it into the model, so fast paths
    that cannot call back per layer (CUDA graphs) stay in use.
    """

    saves_kv_layers: bool

    def register_kv_caches(self, kv_cache: torch.Tensor, model_name: str) -> None:
        """The engine's KV pool ``[L, P, N, B, Hkv, D]`` and the identity of the model that
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


@runtime_checkable
class KVConnector(KVConnectorScheduler, KVConnectorWorker, Protocol):
    """Both halves: what ``LLMEngine`` is given as ``kv_connector``."""


@runtime_checkable
class WindowKVConnector(Protocol):
    """A connector that moves a window pool (``engine/window_kv.py``) as well: the engine
    keeps its window layers' KV in a pool of their own only with such a connector (or
    none), registers that pool too, and announces each send's window table entries; the
    model then calls ``layer_computed`` with the layer's own ``[2, N, B, Hkv, D]`` tensor
    (full layers: a slice of ``kv_cache``, window layers: of the window pool)."""

    moves_window_pool: bool

    def register_window_kv_caches(
        self,
        window_kv_cache: torch.Tensor,
        model_name: str,
        *,
        layers: tuple[int, ...],
        window: int,
    ) -> None:
        """The window pool ``[L_window, 2, N_w, B, Hkv, D]`` holding decoder layers
        ``layers`` (ascending; the others are ``kv_cache``'s, in order), which keep the
        last ``window`` tokens. Called right after ``register_kv_caches``; an int8 / float8
        pool's ``[L_window, 2, Hkv]`` scales come as ``kv_scales=`` (as for
        ``QuantizedKVConnector.register_kv_caches``, whose scales are then the full
        layers' rows)."""


def moves_window_pool(connector: object) -> bool:
    """Whether the engine may keep a window pool beside ``connector`` (None: no
    connector, so yes)."""
    if connector is None:
        return True
    return isinstance(connector, WindowKVConnector) and bool(connector.moves_window_pool)


class QuantizedKVConnector(Protocol):
    """A connector that can move an int8 / float8 pool: it learns the pool's per-layer,
    per-head scales ``[L, 2, Hkv]`` with the pool, and both ends of a hand-off compare
    them (kvtransfer's connectors). The engine registers a quantized pool only this way."""

    def register_kv_caches(
        self, kv_cache: torch.Tensor, model_name: str, *, kv_scales: torch.Tensor | None = None
    ) -> None: ...
