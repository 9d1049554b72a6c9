"""Engine integration, decode side: ``DecodeKVConnector``.

It implements pdserve.engine.kv_connector.KVConnector for an engine whose prompts are
prefilled elsewhere, on top of a ``KVReceiver`` over the engine's pool (built when the engine
registers its pool, as on the prefill side). The serving layer says which requests are
prefilled remotely (``register_load``) before reserving them in the engine; the engine's
scheduler then asks the connector how many prompt tokens it loads
(``get_num_new_matched_tokens``) and tells it which blocks receive them
(``update_state_after_alloc``): the prompt past the engine's prefix-cache hit, so only the
blocks the engine lacks are sent. The serving layer opens the transfer (``expect``: the
``KVTarget`` it hands to the prefill pool), waits for the bytes (``wait``) and fences every
writer (``cancel``) before the request may leave the engine. Loads are pushed by the prefill
peers into the reserved blocks on the receiver's threads, not during the forward pass, so
the worker half has no per-step work.

Window pool (``window_pool=True``, ``engine.kv_connector.WindowKVConnector``): an engine
whose window layers keep only their window's KV in a pool of their own registers that pool
too, and a second receiver fills it under ``window_identity`` (the prefill side's
``PrefillKVConnector(window_pool=True)`` sends there). Such an engine reserves a remote
prefill's window blocks for the first decoded token's window only; the serving layer opens
that second target with ``expect_window`` and ``wait`` / ``cancel`` cover both.

It never allocates or frees engine blocks itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.kvtransfer.blocks import registered_layout
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connector import window_identity
from pdserve.kvtransfer.metrics import TransferObserver
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.results import merge_results
from pdserve.kvtransfer.scheduler_half import LoadPlan, RemoteLoads
from pdserve.kvtransfer.shm import ShmSegment
from pdserve.kvtransfer.types import KVLayout, KVTarget, TransferResult

__all__ = ["DecodeKVConnector", "LoadPlan"]


class DecodeKVConnector(RemoteLoads):
    """pdserve.engine.kv_connector.KVConnector that receives KV through a ``KVReceiver``.

    Its scheduler half (``RemoteLoads``: ``register_load``, ``plan`` and the engine's
    calls) keeps the engine's prefix-cache hit out of the load. ``segment_for`` maps the
    engine's pool to the shared-memory segment holding it (a ``SharedKVAllocator``'s),
    needed to offer the shared-memory transport.
    """

    saves_kv_layers = False  # the peers write into reserved blocks, not the forward pass

    def __init__(
        self,
        config: KVTransferConfig | None = None,
        *,
        observer: TransferObserver | None = None,
        segment_for: Callable[[torch.Tensor], ShmSegment | None] | None = None,
        window_pool: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.observer = observer
        self._segment_for = segment_for
        self._receiver: KVReceiver | None = None
        # Whether the engine may keep a window pool (WindowKVConnector): the prefill side
        # must then send one too.
        self.moves_window_pool = window_pool
        self._window: KVReceiver | None = None  # fills the window pool, once registered

    @property
    def receiver(self) -> KVReceiver:
        """The receiver over the registered pool (exists once the pool is registered)."""
        if self._receiver is None:
            raise RuntimeError("no KV pool registered with the connector yet")
        return self._receiver

    @property
    def layout(self) -> KVLayout:
        """The registered pool's layout (this rank's heads under tensor parallelism)."""
        return self.receiver.layout

    def shm_segment(self, pool: torch.Tensor) -> ShmSegment | None:
        """The shared-memory segment holding ``pool`` (None without ``segment_for``, or
        where the allocator did not place it in one)."""
        return self._segment_for(pool) if self._segment_for is not None else None

    @property
    def receives_window_pool(self) -> bool:
        """Whether the engine registered a window pool: its remote prefills are reserved
        with ``receives_window_pool=True`` and need a window target too."""
        return self._window is not None

    # ---- serving-layer side
    def expect(self, request_id: str, deadline: float | None = None) -> tuple[KVTarget, ...]:
        """Open the reserved request's transfer: the targets (one here) the prefill side
        writes to, valid until ``deadline``. Only the blocks past this engine's prefix
        hit are expected (``KVTarget.first_block`` says where they start)."""
        return (self.expect_plan(request_id, self.require_plan(request_id), deadline),)

    def expect_plan(
        self, request_id: str, plan: LoadPlan, deadline: float | None = None
    ) -> KVTarget:
        """Expect the blocks ``plan`` loads in this pool (the tensor-parallel front passes
        its own plan: every rank holds the same block ids)."""
        first, block_ids = plan.delta(self.layout.block_size)
        return self.receiver.expect(request_id, block_ids, deadline, first_block=first)

    def expect_window(
        self,
        request_id: str,
        first_block: int,
        block_ids: list[int],
        deadline: float | None = None,
    ) -> KVTarget:
        """Open the reserved request's window pool transfer: ``block_ids`` receive the
        window layers' KV of prompt blocks ``first_block`` on (the engine's
        ``remote_window_blocks``: the first decoded token's window, past any prefix hit)."""
        if self._window is None:
            raise ValueError("expect_window: the engine registered no window pool")
        plan = self.require_plan(request_id)
        num_tokens = plan.num_computed_tokens + plan.num_external_tokens
        return self._window.expect(
            request_id, block_ids, deadline, num_tokens=num_tokens, first_block=first_block
        )

    def wait(self, request_id: str, deadline: float | None = None) -> TransferResult:
        """Block until the request's KV landed (its result; with a window pool, both
        transfers' merged) or raise ``KVTransferError``."""
        result = self.receiver.wait(request_id, deadline)
        if self._window is None:
            return result
        return merge_results(request_id, [result, self._window.wait(request_id, deadline)])

    def cancel(self, request_id: str) -> None:
        """Stop expecting the request (idempotent); returns once no peer writes its blocks."""
        for receiver in self._receivers():
            receiver.cancel(request_id)

    def pending(self) -> list[str]:
        """Request ids whose KV is still expected (for leak checks)."""
        return sorted({rid for r in self._receivers() for rid in r.pending()})

    def close(self) -> None:
        """Drop every prefill peer and fail what is still expected."""
        for receiver in self._receivers():
            receiver.close()

    def _receivers(self) -> list[KVReceiver]:
        return [r for r in (self._receiver, self._window) if r is not None]

    # ---- engine side: worker half (KVConnectorWorker)
    def register_kv_caches(
        self,
        kv_cache: torch.Tensor,
        model_name: str,
        *,
        layout: KVLayout | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """The engine's pool (and an int8 / float8 pool's ``[L, 2, H]`` scales). A
        tensor-parallel rank passes ``layout`` (``pool_layout`` with its head range); the
        default is a single-rank pool holding every head."""
        if self._receiver is not None:
            raise RuntimeError("a KV pool is already registered with this connector")
        layout = registered_layout(kv_cache, model_name, layout, kv_scales=kv_scales)
        segment = self.shm_segment(kv_cache)
        self._receiver = KVReceiver(
            kv_cache, layout, self.config, shm_segment=segment, observer=self.observer
        )

    def register_window_kv_caches(
        self,
        window_kv_cache: torch.Tensor,
        model_name: str,
        *,
        layers: tuple[int, ...],
        window: int,
    ) -> None:
        """The engine's window pool (``WindowKVConnector``), filled by a receiver of its
        own under ``window_identity(model_name, window)``, the prefill side's."""
        if not self.moves_window_pool:
            raise ValueError("a window pool needs DecodeKVConnector(window_pool=True)")
        if self._window is not None:
            raise RuntimeError("a window pool is already registered with this connector")
        layout = registered_layout(window_kv_cache, window_identity(model_name, window), None)
        segment = self.shm_segment(window_kv_cache)
        self._window = KVReceiver(
            window_kv_cache, layout, self.config, shm_segment=segment, observer=self.observer
        )

    def begin_step(self, sends: list) -> None:
        if sends:
            raise ValueError(f"a decode connector sends no KV, got {len(sends)} sends")

    def layer_computed(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        pass

    def end_step(self) -> list[str]:
        return []

    def poll_finished(self) -> list[str]:
        return []
