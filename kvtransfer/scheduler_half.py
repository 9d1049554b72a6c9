"""The KV connectors' scheduler halves, written once for every connector that shares them.

``NoExternalLoads`` is the scheduler half of a connector that loads no KV (the prefill side:
``PrefillKVConnector`` and its tensor-parallel front, ``TPPrefillConnector``).
``RemoteLoads`` is the decode side's (``DecodeKVConnector``, ``TPDecodeConnector``): the
serving layer marks a request for a remote load, the engine's scheduler asks how many prompt
tokens come from elsewhere (all it does not hold in its prefix cache) and says which blocks
receive them, and the resulting ``LoadPlan`` says which of the prompt's blocks the transfer
must fill: only those past the prefix cache's hit (a delta hand-off).

Both implement ``pdserve.engine.kv_connector.KVConnectorScheduler``; neither touches
tensors, sockets or engine blocks.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadPlan:
    """Where a request's incoming KV goes: the engine's blocks (the whole block table, prompt
    order) and the prompt tokens ``[num_computed_tokens, num_computed_tokens +
    num_external_tokens)`` they receive; the tokens before are in the prefix cache."""

    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_external_tokens: int

    def delta(self, block_size: int) -> tuple[int, tuple[int, ...]]:
        """The first prompt block the transfer writes and the blocks it writes (those of
        the loaded tokens; the reservation may hold room for generated tokens too).
        ValueError when the held prefix does not end on a block boundary."""
        if self.num_computed_tokens % block_size:
            raise ValueError(
                f"num_computed_tokens: {self.num_computed_tokens} is not a whole number of "
                f"blocks of {block_size} (only full cached blocks are kept)"
            )
        if self.num_external_tokens < 1:
            raise ValueError(f"num_external_tokens: {self.num_external_tokens}; nothing to load")
        first = self.num_computed_tokens // block_size
        end = math.ceil((self.num_computed_tokens + self.num_external_tokens) / block_size)
        if end > len(self.block_ids):
            raise ValueError(
                f"block_ids: {len(self.block_ids)} reserved, the prompt needs {end} blocks"
            )
        return first, self.block_ids[first:end]


class NoExternalLoads:
    """Scheduler half of a connector whose engine loads no KV from elsewhere."""

    def get_num_new_matched_tokens(
        self, request_id: str, num_prompt_tokens: int, num_computed_tokens: int
    ) -> int:
        return 0

    def update_state_after_alloc(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        raise ValueError(f"request {request_id!r}: this connector receives no KV")

    def request_finished(self, request_id: str) -> None:
        pass


class RemoteLoads:
    """Scheduler half of a decode connector: which requests are loaded remotely and where.

    Thread-safe: the serving layer registers loads from its event loop while the engine's
    scheduler reserves them on the engine thread."""

    def __init__(self) -> None:
        self._loads_lock = threading.Lock()
        self._remote: set[str] = set()  # registered, not yet reserved
        self._plans: dict[str, LoadPlan] = {}

    # ---- serving-layer side
    def register_load(self, request_id: str) -> None:
        """Say that request ``request_id``'s prompt KV comes from a remote prefill (call
        before reserving it in the engine)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        with self._loads_lock:
            self._remote.add(request_id)

    def unregister_load(self, request_id: str) -> None:
        """Undo ``register_load`` for a request that was not reserved (idempotent)."""
        with self._loads_lock:
            self._remote.discard(request_id)

    def plan(self, request_id: str) -> LoadPlan | None:
        """Where the reserved request's KV goes (None if it is not reserved for a load)."""
        with self._loads_lock:
            return self._plans.get(request_id)

    def require_plan(self, request_id: str) -> LoadPlan:
        """``plan``, or ValueError naming the request when it has none."""
        plan = self.plan(request_id)
        if plan is None:
            raise ValueError(f"request_id {request_id!r} has no KV reserved for a remote load")
        return plan

    # ---- engine side (KVConnectorScheduler)
    def get_num_new_matched_tokens(
        self, request_id: str, num_prompt_tokens: int, num_computed_tokens: int
    ) -> int:
        with self._loads_lock:
            remote = request_id in self._remote
        return max(0, num_prompt_tokens - num_computed_tokens) if remote else 0

    def update_state_after_alloc(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        with self._loads_lock:
            self._remote.discard(request_id)
            self._plans[request_id] = LoadPlan(
                tuple(block_ids), num_computed_tokens, num_external_tokens
            )

    def request_finished(self, request_id: str) -> None:
        with self._loads_lock:
            self._remote.discard(request_id)
            self._plans.pop(request_id, None)
