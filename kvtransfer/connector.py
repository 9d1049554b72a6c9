"""Engine integration: the prefill-side ``KVConnector`` and the decode-side hand-off glue.

``PrefillKVConnector`` implements pdserve.engine.kv_connector.KVConnector on top of a ``KVSender``:
the serving layer registers a ``KVTarget`` per request id before the request is added with
``prefill_only=True``; when the engine's step completes that prefill, the connector opens
the transfer and enqueues each layer as the model computes it. A request without a target,
or whose transfer fails, is still reported finished so the engine frees its blocks; its
``TransferResult`` says what went wrong.

``DecodeHandoff`` drives a decode-role engine: reserve blocks, ``expect`` them, (the
prefill happens elsewhere), ``wait``, then ``complete_remote_prefill`` — or
``fail_remote_prefill`` (local recompute into the same blocks) on any failure.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pdserve.kvtransfer.blocks import dtype_name
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender, SendHandle
from pdserve.kvtransfer.types import KVLayout, KVTarget, KVTransferError, TransferResult

if TYPE_CHECKING:  # the engine's protocol types; kvtransfer does not import engine at runtime
    from pdserve.engine.kv_connector import PendingSend


_MAX_UNCLAIMED_RESULTS = 4096


def engine_layout(engine: Any) -> KVLayout:
    """The KV layout of an ``LLMEngine`` (model identity, shape and dtype of its pool)."""
    mc = engine.model_config
    return KVLayout(
        model=str(mc.model_name),
        num_layers=int(mc.num_layers),
        num_kv_heads=int(mc.num_kv_heads),
        head_dim=int(mc.head_dim),
        block_size=int(engine.block_size),
        dtype=dtype_name(engine.kv_cache.dtype),
    )


class PrefillKVConnector:
    """pdserve.engine.kv_connector.KVConnector that streams KV through a ``KVSender``."""

    def __init__(self, sender: KVSender) -> None:
        self.sender = sender
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


class RemotePrefillEngine(Protocol):
    """What ``DecodeHandoff`` needs of a decode-role engine (``LLMEngine`` has it)."""

    block_size: int

    def reserve_remote_prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: Any = None
    ) -> list[int] | None: ...

    def complete_remote_prefill(
        self, request_id: str, first_token_id: int, first_logprobs: Any = None
    ) -> None: ...

    def fail_remote_prefill(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> Any: ...


class DecodeHandoff:
    """Decode-side glue between an engine in decode role and a ``KVReceiver``.

    Not thread-safe with respect to the engine: call it from the thread that drives the
    engine (or wrap the engine calls, as AsyncLLMEngine does).
    """

    def __init__(self, engine: RemotePrefillEngine, receiver: KVReceiver) -> None:
        self.engine = engine
        self.receiver = receiver

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: Any = None,
        deadline: float | None = None,
    ) -> KVTarget | None:
        """Reserve blocks and return where the prefill side must write; None if no room."""
        block_ids = self.engine.reserve_remote_prefill(request_id, prompt_token_ids, params)
        if block_ids is None:
            return None
        needed = math.ceil(len(prompt_token_ids) / self.engine.block_size)
        try:
            return self.receiver.expect(request_id, block_ids[:needed], deadline)
        except Exception:
            self.engine.abort(request_id)
            raise

    def complete(
        self, request_id: str, first_token_id: int | None, first_logprobs: Any = None
    ) -> TransferResult:
        """Wait for the KV; then start decoding with ``first_token_id``. On any failure
        (``first_token_id`` None: the prefill side failed) recompute locally instead."""
        if first_token_id is None:
            self.receiver.cancel(request_id)
            self.engine.fail_remote_prefill(request_id)
            return TransferResult(
                request_id=request_id, ok=False, bytes=0, seconds=0.0, error="prefill failed"
            )
        try:
            result = self.receiver.wait(request_id)
        except KVTransferError as exc:
            self.engine.fail_remote_prefill(request_id)
            return TransferResult(
                request_id=request_id, ok=False, bytes=0, seconds=0.0, error=str(exc)
            )
        self.engine.complete_remote_prefill(request_id, first_token_id, first_logprobs)
        return result

    def run(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: Any,
        prefill: Callable[[KVTarget], int | None],
        deadline: float | None = None,
    ) -> TransferResult | None:
        """reserve -> ``prefill(target)`` (returns the first token id, or None/raises on
        failure) -> complete. None when the pool had no room (nothing held)."""
        target = self.reserve(request_id, prompt_token_ids, params, deadline)
        if target is None:
            return None
        try:
            first = prefill(target)
        except Exception:  # noqa: BLE001 - any prefill failure falls back to local compute
            first = None
        return self.complete(request_id, first)

    def abort(self, request_id: str) -> None:
        """Give up on the request: stop expecting its KV and free its blocks."""
        self.receiver.cancel(request_id)
        self.engine.abort(request_id)
