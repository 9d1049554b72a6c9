"""Engine integration, prefill side: ``PrefillKVConnector``.

It implements pdserve.engine.kv_connector.KVConnector on top of a ``KVSender``. As in vLLM
v1, the connector is built before the engine and the engine registers its KV pool with it
once allocated (``register_kv_caches``): that is when the sender, which needs the pool's
layout and device, is created. The serving layer registers a ``KVTarget`` per request id
before the request is added with ``prefill_only=True``; when the engine's step completes
that prefill, the connector opens the transfer and enqueues each layer as the model computes
it. A request without a target, or whose transfer fails, is still reported finished so the
engine frees its blocks; its ``TransferResult`` says what went wrong.

The decode side of a hand-off is driven by the serving layer
(``pdserve.deployments.remote_prefill``) straight on ``KVReceiver``; it has no glue here.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import TYPE_CHECKING

import torch

from pdserve.kvtransfer.blocks import pool_layout
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.metrics import TransferObserver
from pdserve.kvtransfer.send_handle import SendHandle
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.types import KVTarget, KVTransferError, TransferResult

if TYPE_CHECKING:  # the engine's protocol types; kvtransfer does not import engine at runtime
    from pdserve.engine.kv_connector import PendingSend


_MAX_UNCLAIMED_RESULTS = 4096


class PrefillKVConnector:
    """pdserve.engine.kv_connector.KVConnector that streams KV through a ``KVSender``."""

    def __init__(
        self,
        config: KVTransferConfig | None = None,
        *,
        observer: TransferObserver | None = None,
    ) -> None:
        self.config = config
        self.observer = observer
        self._sender: KVSender | None = None
        self._lock = threading.Lock()
        self._targets: dict[str, KVTarget] = {}
        self._active: dict[str, SendHandle] = {}
        self._step: list[SendHandle] = []
        self._in_step: set[str] = set()
        # Results wait here for take_result(); bounded, oldest dropped, in case a caller
        # never asks (e.g. a request aborted after its send began).
        self._results: collections.OrderedDict[str, TransferResult] = collections.OrderedDict()
        self._finished: list[str] = []
        self._result_ready = threading.Condition(self._lock)

    @property
    def sender(self) -> KVSender:
        """The sender streaming the registered pool (exists once the pool is registered)."""
        if self._sender is None:
            raise RuntimeError("no KV pool registered with the connector yet")
        return self._sender

    # ---- serving-layer side
    def register_target(self, request_id: str, target: KVTarget) -> None:
        """Say where request ``request_id``'s KV goes (call before adding the request)."""
        if target.request_id != request_id:
            raise ValueError(
                f"target.request_id: {target.request_id!r} differs from {request_id!r}"
            )
        with self._lock:
            self._targets[request_id] = target

    def unregister_target(self, request_id: str) -> None:
        with self._lock:
            self._targets.pop(request_id, None)

    def take_result(self, request_id: str, timeout: float | None = None) -> TransferResult | None:
        """The request's transfer result once it ended (waits up to ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._result_ready:
            while request_id not in self._results:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._result_ready.wait(remaining)
            return self._results.pop(request_id)

    # ---- engine side (KVConnector protocol)
    def register_kv_caches(self, kv_cache: torch.Tensor, model_name: str) -> None:
        if self._sender is not None:
            raise RuntimeError("a KV pool is already registered with this connector")
        self._sender = KVSender(
            pool_layout(kv_cache, model_name),
            self.config,
            device=kv_cache.device.type,
            observer=self.observer,
        )

    def begin_step(self, sends: list[PendingSend]) -> None:
        handles: list[SendHandle] = []
        for send in sends:
            with self._lock:
                target = self._targets.pop(send.request_id, None)
            if target is None:
                self._settle_now(send.request_id, "no KVTarget registered for this request")
                continue
            needed = math.ceil(send.num_tokens / target.layout.block_size)
            if needed != len(target.block_ids):
                self._settle_now(
                    send.request_id,
                    f"the target has {len(target.block_ids)} blocks for {send.num_tokens} "
                    f"tokens ({needed} blocks)",
                )
                continue
            try:
                handle = self.sender.open(target, list(send.block_ids))
            except (ValueError, KVTransferError) as exc:
                self._settle_now(send.request_id, str(exc))
                continue
            handles.append(handle)
        with self._lock:
            for h in handles:
                self._active[h.request_id] = h
            self._step = handles
            self._in_step = {s.request_id for s in sends}

    def layer_computed(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        for handle in self._step:
            self.sender.send_layer(handle, layer_idx, kv_cache)

    def end_step(self) -> list[str]:
        # Requests begun in this step are reported from the next poll on: the engine only
        # starts tracking them as "sending" once the step's outputs are processed.
        with self._lock:
            begun, self._in_step = self._in_step, set()
            self._step = []
        return self._collect(exclude=begun)

    def poll_finished(self) -> list[str]:
        return self._collect(exclude=set())

    def _collect(self, exclude: set[str]) -> list[str]:
        now = time.time()
        with self._lock:
            # A send past its deadline is over even if the peer never answered (finish()
            # below then fails it at once): the engine must get its blocks back.
            done = [h for h in self._active.values() if h.done() or now > h.target.deadline]
            for h in done:
                del self._active[h.request_id]
        for h in done:
            # Blocks may be freed now: every write into the peer has completed or stopped.
            self._record(h.request_id, self.sender.finish(h, check=False))
        with self._lock:
            finished = [rid for rid in self._finished if rid not in exclude]
            self._finished = [rid for rid in self._finished if rid in exclude]
        return finished

    def _settle_now(self, request_id: str, error: str) -> None:
        self._record(
            request_id,
            TransferResult(request_id=request_id, ok=False, bytes=0, seconds=0.0, error=error),
        )

    def _record(self, request_id: str, result: TransferResult) -> None:
        with self._result_ready:
            self._results[request_id] = result
            while len(self._results) > _MAX_UNCLAIMED_RESULTS:
                self._results.popitem(last=False)
            self._finished.append(request_id)
            self._result_ready.notify_all()
