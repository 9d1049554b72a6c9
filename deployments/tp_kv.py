"""KV hand-off of tensor-parallel replicas: every rank moves the KV heads it holds.

A prefill replica of TP=a and a decode replica of TP=b exchange KV rank to rank: each
decode rank has its own ``KVReceiver`` (its pool holds its heads) and so its own
``KVTarget``; each prefill rank's connector sends, to every target, the heads it holds
canonically that the target's rank holds (``pdserve.kvtransfer`` maps the heads). Rank 0 of
each replica speaks for all ranks to the serving layer:

- prefill: ``TPPrefillConnector`` (rank 0's engine connector) hands each request's targets
  to the workers' connectors with the next step and merges their results: a request's
  transfer succeeded only if every rank's sends did;
- decode: ``TPDecodeConnector`` (rank 0's engine connector) expects a request on every rank
  (the workers' receivers through the executor's control channel) and waits for all of them.

Both are the engine's ``TPConnector``: the executor attaches itself to them, so the serving
layer never reaches past the engine to its ranks.

The workers' halves are built on the worker ranks by the picklable factories
``PrefillAgentFactory`` / ``DecodeAgentFactory`` (``pdserve.engine.tp_executor``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.parallel import TPShard
from pdserve.kvtransfer.blocks import pool_layout
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connector import PrefillKVConnector, window_identity
from pdserve.kvtransfer.decode_connector import DecodeKVConnector
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.results import ResultMailbox, merge_results
from pdserve.kvtransfer.scheduler_half import NoExternalLoads, RemoteLoads
from pdserve.kvtransfer.types import (
    KVLayout,
    KVTarget,
    KVTransferError,
    KVTransferTimeoutError,
    TransferResult,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pdserve.engine.kv_connector import PendingSend
    from pdserve.engine.tp_executor import TPExecutor
    from pdserve.engine.tp_worker import RankPool


def rank_layout(
    kv_cache: torch.Tensor,
    model_name: str,
    shard: TPShard,
    kv_heads: int,
    kv_scales: torch.Tensor | None = None,
) -> KVLayout:
    """The layout of one rank's pool: its KV heads among the model's ``kv_heads`` (with
    ``kv_scales``, an int8 / float8 pool's ``[L, 2, H]`` scales of those heads)."""
    heads = shard.kv_heads(kv_heads)
    return pool_layout(
        kv_cache,
        model_name,
        kv_head_start=heads.start,
        total_kv_heads=kv_heads,
        kv_head_replica=shard.kv_replica(kv_heads),
        tp_size=shard.size,
        tp_rank=shard.rank,
        kv_scales=kv_scales,
    )


def pool_rank_layout(pool: RankPool) -> KVLayout:
    """``rank_layout`` of a worker rank's pool."""
    return rank_layout(pool.kv_cache, pool.model_name, pool.shard, pool.kv_heads, pool.kv_scales)


def _rank0_window_layout(
    executor: TPExecutor,
    window_kv_cache: torch.Tensor,
    model_name: str,
    window: int,
    kv_scales: torch.Tensor | None,
) -> KVLayout:
    """``rank_layout`` of rank 0's window pool, under the window pool's identity."""
    identity = window_identity(model_name, window)
    heads = executor.model_config.num_kv_heads
    return rank_layout(window_kv_cache, identity, executor.tp.shard, heads, kv_scales)


def window_rank_layout(pool: RankPool) -> KVLayout | None:
    """``rank_layout`` of a worker rank's window pool (None without one), under the window
    pool's identity (``kvtransfer.connector.window_identity``)."""
    if pool.window_kv_cache is None or pool.window_layout is None:
        return None
    identity = window_identity(pool.model_name, pool.window_layout.window)
    return rank_layout(
        pool.window_kv_cache, identity, pool.shard, pool.kv_heads, pool.window_kv_scales
    )


def replica_kv_bytes_per_token(
    kv_cache: torch.Tensor, kv_heads: int, window_kv_cache: torch.Tensor | None = None
) -> int:
    """Bytes of one token's KV over a whole replica: every layer and plane, each of the
    model's ``kv_heads`` once (``kv_cache`` is one rank's pool ``[L, P, N, B, Hkv, D]``).
    An engine whose window layers keep their KV in a pool of their own (``window_kv_cache``
    ``[L_window, P, N_w, B, Hkv, D]``) counts those layers too: a token inside the window
    holds KV on every layer."""
    num_layers, planes, _, _, _, head_dim = kv_cache.shape
    if window_kv_cache is not None:
        num_layers += window_kv_cache.shape[0]
    return num_layers * planes * kv_heads * head_dim * kv_cache.element_size()


# ---- prefill ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTargets:
    """What rank 0 sends the workers' connectors with a step."""

    register: tuple[tuple[str, tuple[KVTarget, ...]], ...] = ()
    unregister: tuple[str, ...] = ()
    # With window pools: the registered requests' window pool targets (one per decode rank).
    window: tuple[tuple[str, tuple[KVTarget, ...]], ...] = ()


class PrefillRankAgent:
    """A worker rank's prefill connector (``RankKVAgent``)."""

    def __init__(self, connector: PrefillKVConnector) -> None:
        self.connector = connector

    def apply_step_meta(self, meta: StepTargets | None) -> None:
        if meta is None:
            return
        for rid in meta.unregister:
            self.connector.unregister_target(rid)
        window = dict(meta.window)
        for rid, targets in meta.register:
            self.connector.register_target(rid, targets, window_target=window.get(rid))

    def step_report(self, finished: list[str]) -> list[tuple[str, TransferResult]]:
        report = []
        for rid in finished:
            result = self.connector.take_result(rid, timeout=0)
            if result is not None:
                report.append((rid, result))
        return report

    def close(self) -> None:
        self.connector.close()


@dataclass(frozen=True)
class PrefillAgentFactory:
    """Builds a worker rank's ``PrefillRankAgent`` (sent to the rank by value)."""

    transfer: KVTransferConfig

    def __call__(self, pool: RankPool) -> PrefillRankAgent:
        # A rank keeps a window pool only where rank 0's connector moves one.
        window_layout = window_rank_layout(pool)
        connector = PrefillKVConnector(self.transfer, window_pool=window_layout is not None)
        connector.register_kv_caches(pool.kv_cache, pool.model_name, layout=pool_rank_layout(pool))
        if window_layout is not None:
            assert pool.window_kv_cache is not None and pool.window_layout is not None
            connector.register_window_kv_caches(
                pool.window_kv_cache,
                pool.model_name,
                layers=pool.window_layout.layers,
                window=pool.window_layout.window,
                layout=window_layout,
            )
        return PrefillRankAgent(connector)


class TPPrefillConnector(NoExternalLoads):
    """Rank 0's engine connector for a tensor-parallel prefill replica (``TPConnector``;
    its scheduler half loads nothing).

    The serving layer uses it as it uses a ``PrefillKVConnector``: ``register_target`` (one
    target per decode rank; with window pools, ``window_target`` one per decode rank too),
    ``unregister_target``, ``take_result``. With ``local`` built ``window_pool=True`` every
    rank keeps its window pool and sends its window layers' blocks of the first decoded
    token's window to the decode ranks' window pools (``engine.kv_connector.
    WindowKVConnector``)."""

    def __init__(self, local: PrefillKVConnector) -> None:
        self.local = local
        self.moves_window_pool = local.moves_window_pool
        self._executor: TPExecutor | None = None
        self._lock = threading.Lock()
        self._register: dict[str, tuple[KVTarget, ...]] = {}
        self._window: dict[str, tuple[KVTarget, ...]] = {}
        self._unregister: list[str] = []
        self._parts: dict[str, list[TransferResult]] = {}  # each rank's, as they arrive
        self._results = ResultMailbox()  # merged over the ranks, for take_result()

    saves_kv_layers = True

    @property
    def sender(self) -> Any:
        return self.local.sender

    def close(self) -> None:
        """Close rank 0's sender (the workers' close with their ranks)."""
        self.local.close()

    # ---- TPConnector
    def attach(self, executor: TPExecutor) -> None:
        self._executor = executor

    def step_meta(self) -> StepTargets:
        with self._lock:
            meta = StepTargets(
                tuple(self._register.items()),
                tuple(self._unregister),
                tuple(self._window.items()),
            )
            self._register, self._unregister, self._window = {}, [], {}
        return meta

    def worker_reports(self, reports: list[Any]) -> None:
        for report in reports:
            for rid, result in report or ():
                self._parts.setdefault(rid, []).append(result)

    # ---- serving-layer side
    def register_target(
        self,
        request_id: str,
        targets: KVTarget | tuple[KVTarget, ...],
        *,
        window_target: KVTarget | tuple[KVTarget, ...] | None = None,
    ) -> None:
        targets = (targets,) if isinstance(targets, KVTarget) else tuple(targets)
        self.local.register_target(request_id, targets, window_target=window_target)
        with self._lock:
            self._register[request_id] = targets
            if window_target is not None:
                window = (window_target,) if isinstance(window_target, KVTarget) else window_target
                self._window[request_id] = tuple(window)

    def unregister_target(self, request_id: str) -> None:
        self.local.unregister_target(request_id)
        with self._lock:
            self._window.pop(request_id, None)
            if self._register.pop(request_id, None) is None:
                self._unregister.append(request_id)

    def take_result(self, request_id: str, timeout: float | None = None) -> TransferResult | None:
        return self._results.take(request_id, timeout)

    # ---- KVConnector, worker half (rank 0's engine thread)
    def register_kv_caches(
        self, kv_cache: torch.Tensor, model_name: str, *, kv_scales: torch.Tensor | None = None
    ) -> None:
        executor = self._executor
        if executor is None:
            raise RuntimeError("TPPrefillConnector: the executor did not attach")
        heads = executor.model_config.num_kv_heads
        layout = rank_layout(kv_cache, model_name, executor.tp.shard, heads, kv_scales)
        self.local.register_kv_caches(kv_cache, model_name, layout=layout)

    def register_window_kv_caches(
        self,
        window_kv_cache: torch.Tensor,
        model_name: str,
        *,
        layers: tuple[int, ...],
        window: int,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Rank 0's window pool (``WindowKVConnector``), its heads under the window pool's
        identity (the workers register theirs through ``PrefillAgentFactory``)."""
        executor = self._executor
        if executor is None:
            raise RuntimeError("TPPrefillConnector: the executor did not attach")
        layout = _rank0_window_layout(executor, window_kv_cache, model_name, window, kv_scales)
        self.local.register_window_kv_caches(
            window_kv_cache, model_name, layers=layers, window=window, layout=layout
        )

    def begin_step(self, sends: list[PendingSend]) -> None:
        self.local.begin_step(sends)

    def layer_computed(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        self.local.layer_computed(layer_idx, kv_cache)

    def end_step(self) -> list[str]:
        return self._settle(self.local.end_step())

    def poll_finished(self) -> list[str]:
        executor = self._executor
        if executor is not None:
            self.worker_reports(executor.poll_workers(self.step_meta()))
        return self._settle(self.local.poll_finished())

    def _settle(self, local_done: list[str]) -> list[str]:
        """Requests whose sends finished on every rank (their blocks may be freed)."""
        for rid in local_done:
            result = self.local.take_result(rid, timeout=0)
            if result is not None:
                self._parts.setdefault(rid, []).append(result)
        size = self._executor.tp.size if self._executor is not None else 1
        done = [rid for rid, parts in self._parts.items() if len(parts) >= size]
        for rid in done:
            self._results.put(rid, merge_results(rid, self._parts.pop(rid)))
        return done


# ---- decode ----------------------------------------------------------------------------------


class DecodeRankAgent:
    """A worker rank's receiver (``RankKVAgent``) and, where the rank keeps a window pool,
    that pool's receiver; rank 0 calls it through the executor."""

    connector = None

    def __init__(self, receiver: KVReceiver, window: KVReceiver | None = None) -> None:
        self.receiver = receiver
        self.window = window

    def apply_step_meta(self, meta: Any) -> None:
        pass

    def step_report(self, finished: list[str]) -> None:
        return None

    def expect(
        self, request_id: str, block_ids: tuple[int, ...], deadline: float, first_block: int
    ) -> KVTarget:
        return self.receiver.expect(request_id, block_ids, deadline, first_block=first_block)

    def expect_window(
        self, request_id: str, block_ids: tuple[int, ...], deadline: float, first_block: int
    ) -> KVTarget:
        if self.window is None:
            raise ValueError("this rank keeps no window pool")
        return self.window.expect(request_id, block_ids, deadline, first_block=first_block)

    def wait(self, request_id: str, deadline: float) -> TransferResult:
        return _wait_both(self.receiver, self.window, request_id, deadline)

    def cancel(self, request_id: str) -> None:
        self.receiver.cancel(request_id)
        if self.window is not None:
            self.window.cancel(request_id)

    def pending(self) -> list[str]:
        return _pending_both(self.receiver, self.window)

    def close(self) -> None:
        self.receiver.close()
        if self.window is not None:
            self.window.close()


def _wait_both(
    receiver: KVReceiver, window: KVReceiver | None, request_id: str, deadline: float | None
) -> TransferResult:
    """The request's KV landed in the pool and, with a window pool, in that too (merged)."""
    full = receiver.wait(request_id, deadline)
    if window is None:
        return full
    return merge_results(request_id, [full, window.wait(request_id, deadline)])


def _pending_both(receiver: KVReceiver, window: KVReceiver | None) -> list[str]:
    return receiver.pending() + (window.pending() if window is not None else [])


@dataclass(frozen=True)
class DecodeAgentFactory:
    """Builds a worker rank's ``DecodeRankAgent`` (its pool is private memory, so the
    rank offers torch.distributed, or CUDA IPC on a GPU, not shared memory)."""

    transfer: KVTransferConfig

    def __call__(self, pool: RankPool) -> DecodeRankAgent:
        receiver = KVReceiver(pool.kv_cache, pool_rank_layout(pool), self.transfer)
        window_layout = window_rank_layout(pool)
        window = None
        if pool.window_kv_cache is not None and window_layout is not None:
            window = KVReceiver(pool.window_kv_cache, window_layout, self.transfer)
        return DecodeRankAgent(receiver, window)


class TPDecodeConnector(RemoteLoads):
    """Rank 0's engine connector for a tensor-parallel decode replica (``TPConnector``).

    The serving layer uses it as it uses a ``DecodeKVConnector``: ``register_load``,
    ``expect`` (one target per rank, rank order), ``wait`` (every rank's KV landed),
    ``cancel`` (every rank fenced). The scheduler half (``RemoteLoads``) is this object's:
    every rank holds the same block ids, so one plan serves them all.

    ``window_pool=True`` (``engine.kv_connector.WindowKVConnector``): every rank keeps its
    window layers' KV in a window pool with a receiver of its own; each request then also
    needs ``expect_window`` (the engine's ``remote_window_blocks``), and ``wait`` / ``cancel``
    / ``pending`` cover both pools."""

    saves_kv_layers = False

    def __init__(self, local: DecodeKVConnector, *, window_pool: bool = False) -> None:
        super().__init__()
        self.local = local
        self.moves_window_pool = window_pool
        self._window: KVReceiver | None = None  # rank 0's window pool receiver
        self._executor: TPExecutor | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def layout(self) -> KVLayout:
        """Rank 0's pool layout (its heads)."""
        return self.local.layout

    @property
    def receives_window_pool(self) -> bool:
        """Whether the engine registered a window pool (every rank keeps one): its remote
        prefills are reserved with ``receives_window_pool=True`` and need ``expect_window``."""
        return self._window is not None

    def _workers(self) -> tuple[TPExecutor, range]:
        executor = self._executor
        if executor is None:
            raise RuntimeError("TPDecodeConnector: the executor did not attach")
        return executor, range(1, executor.tp.size)

    # ---- TPConnector
    def attach(self, executor: TPExecutor) -> None:
        self._executor = executor
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=4 * (executor.tp.size - 1), thread_name_prefix="pdserve-tp-kv"
        )

    def step_meta(self) -> None:
        return None  # the workers' receivers are driven beside the steps (agent calls)

    def worker_reports(self, reports: list[Any]) -> None:
        pass

    # ---- serving-layer side
    def expect(self, request_id: str, deadline: float | None = None) -> tuple[KVTarget, ...]:
        """Expect the request on every rank: one target per rank, rank order."""
        first = self.local.expect_plan(request_id, self.require_plan(request_id), deadline)
        return self._expect_on_workers(request_id, first, "expect")

    def expect_window(
        self,
        request_id: str,
        first_block: int,
        block_ids: list[int] | tuple[int, ...],
        deadline: float | None = None,
    ) -> tuple[KVTarget, ...]:
        """Expect the request's window layers' KV on every rank's window pool (``first_block``
        and ``block_ids``: the engine's ``remote_window_blocks``): one target per rank."""
        if self._window is None:
            raise RuntimeError("TPDecodeConnector: no window pool registered")
        first = self._window.expect(request_id, block_ids, deadline, first_block=first_block)
        return self._expect_on_workers(request_id, first, "expect_window")

    def _expect_on_workers(
        self, request_id: str, first: KVTarget, method: str
    ) -> tuple[KVTarget, ...]:
        """Rank 0's target ``first`` and the workers' for the same blocks (their agents'
        ``method``); every rank fenced again if one fails."""
        executor, ranks = self._workers()
        targets = [first]
        try:
            for rank in ranks:
                targets.append(
                    executor.agent_call(
                        rank,
                        method,
                        request_id,
                        tuple(first.block_ids),
                        first.deadline,
                        first.first_block,
                    )
                )
        except BaseException:
            self.cancel(request_id)
            raise
        return tuple(targets)

    def wait(self, request_id: str, deadline: float | None = None) -> TransferResult:
        """Every rank's KV landed (returns the merged result) or one failed (raises, after
        cancelling the others so no peer still writes)."""
        executor, ranks = self._workers()
        assert self._pool is not None
        timeout = None if deadline is None else max(0.0, deadline - time.time()) + 5.0
        futures = [
            self._pool.submit(
                executor.agent_call, rank, "wait", request_id, deadline, timeout=timeout
            )
            for rank in ranks
        ]
        parts: list[TransferResult] = []
        try:
            parts.append(_wait_both(self.local.receiver, self._window, request_id, deadline))
            parts.extend(f.result() for f in futures)
        except Exception as exc:
            self.cancel(request_id)
            if isinstance(exc, KVTransferError):
                raise
            if isinstance(exc, TimeoutError):
                raise KVTransferTimeoutError(f"request {request_id!r}: {exc}") from exc
            raise KVTransferError(f"request {request_id!r}: {exc}") from exc
        return merge_results(request_id, parts)

    def cancel(self, request_id: str) -> None:
        self.local.cancel(request_id)
        if self._window is not None:
            self._window.cancel(request_id)
        executor = self._executor
        if executor is None:
            return
        for rank in range(1, executor.tp.size):
            # A dead rank writes nothing any more (and takes the replica down).
            with contextlib.suppress(Exception):
                executor.agent_call(rank, "cancel", request_id)

    def pending(self) -> list[str]:
        if self._window is None:
            return self.local.pending()
        return _pending_both(self.local.receiver, self._window)

    def close(self) -> None:
        self.local.close()
        if self._window is not None:
            self._window.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- KVConnector, worker half (rank 0's engine thread)
    def register_kv_caches(
        self, kv_cache: torch.Tensor, model_name: str, *, kv_scales: torch.Tensor | None = None
    ) -> None:
        executor, _ = self._workers()
        heads = executor.model_config.num_kv_heads
        layout = rank_layout(kv_cache, model_name, executor.tp.shard, heads, kv_scales)
        self.local.register_kv_caches(kv_cache, model_name, layout=layout)

    def register_window_kv_caches(
        self,
        window_kv_cache: torch.Tensor,
        model_name: str,
        *,
        layers: tuple[int, ...],
        window: int,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Rank 0's window pool: a receiver of its own, its heads under the window pool's
        identity (the workers' come from ``DecodeAgentFactory``)."""
        if not self.moves_window_pool:
            raise ValueError("a window pool needs TPDecodeConnector(..., window_pool=True)")
        if self._window is not None:
            raise RuntimeError("a window pool is already registered with this connector")
        executor, _ = self._workers()
        layout = _rank0_window_layout(executor, window_kv_cache, model_name, window, kv_scales)
        # Rank 0's pools come from the replica's allocator: a shared-memory segment on a CPU,
        # so its window receiver offers the full pool's transport.
        self._window = KVReceiver(
            window_kv_cache,
            layout,
            self.local.config,
            shm_segment=self.local.shm_segment(window_kv_cache),
            observer=self.local.observer,
        )

    def begin_step(self, sends: list[PendingSend]) -> None:
        self.local.begin_step(sends)

    def layer_computed(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        pass

    def end_step(self) -> list[str]:
        return []

    def poll_finished(self) -> list[str]:
        return []
