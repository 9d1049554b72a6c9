"""Engine integration, prefill side: ``PrefillKVConnector``.

It implements pdserve.engine.kv_connector.KVConnector on top of a ``KVSender``. As in vLLM
v1, the connector is built before the engine and the engine registers its KV pool with it
once allocated (``register_kv_caches``): that is when the sender, which needs the pool's
layout and device, is created. The serving layer registers a request's ``KVTarget``s (one
per rank of the decode replica) before the request is added with ``prefill_only=True``. The
engine announces, in every step that computes a chunk of that prompt, the blocks the chunk
completes (``PendingSend``): at the first such step the connector opens one send per target
that gets heads from this pool (a tensor-parallel rank sends the heads it holds canonically
to the decode ranks holding them, see ``tp_plan``; a replica copy sends nothing), and in
every such step it enqueues, as the model computes each layer, that layer of this step's
blocks only (one message per layer per send), so a long prompt's earlier chunks move while
its later ones are computed. The transfer ends when the decode side confirmed every block
of the final chunk, or when it fails, or when the engine cancels it (the request left
before its final chunk: the decode side is told). The request's ``TransferResult`` is ok
only if every send succeeded; its bytes are their sum. A request without a target, or whose
transfer fails, is still reported finished (once) so the engine frees its blocks; its
result says what went wrong.

Delta hand-off: a target whose ``first_block`` is k says the decode side already holds the
prompt's first k blocks (its prefix cache); only the blocks from k on are sent, and the
transfer opens at the first step that completes one of them.

Window pool (``window_pool=True``, ``engine.kv_connector.WindowKVConnector``): an engine
whose window layers keep only their window's KV in a pool of their own registers that pool
too; a second connector of this class streams it, to a second target per request (the decode
side's window pool) whose ``first_block`` is the first block the first decoded token's
window reaches, so only those blocks of the window layers move. The request is finished
once both transfers ended; its result merges theirs.

Its scheduler half has nothing to do: a prefill engine loads no KV from elsewhere. The
decode side's connector is ``pdserve.kvtransfer.decode_connector.DecodeKVConnector``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.kvtransfer import tp_plan
from pdserve.kvtransfer.blocks import registered_layout
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.metrics import TransferObserver
from pdserve.kvtransfer.results import ResultMailbox, merge_results
from pdserve.kvtransfer.scheduler_half import NoExternalLoads
from pdserve.kvtransfer.send_handle import SendHandle
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.types import KVLayout, KVTarget, KVTransferError, TransferResult

if TYPE_CHECKING:  # the engine's protocol types; kvtransfer does not import engine at runtime
    from pdserve.engine.kv_connector import PendingSend


class PrefillKVConnector(NoExternalLoads):
    """pdserve.engine.kv_connector.KVConnector that streams KV through a ``KVSender`` (its
    scheduler half, ``NoExternalLoads``, has nothing to do: a prefill engine loads no KV)."""

    saves_kv_layers = True  # reads each layer's KV as the model writes it

    def __init__(
        self,
        config: KVTransferConfig | None = None,
        *,
        observer: TransferObserver | None = None,
        window_pool: bool = False,
    ) -> None:
        self.config = config
        self.observer = observer
        # Whether the engine may keep a window pool (WindowKVConnector): the decode side
        # must then receive one too.
        self.moves_window_pool = window_pool
        self._window: PrefillKVConnector | None = None  # streams the window pool
        self._layer_map: list[tuple[bool, int]] | None = None  # layer -> (window?, index)
        self._halves: dict[str, int] = {}  # requests one of whose two transfers ended
        self._sender: KVSender | None = None
        self._lock = threading.Lock()
        self._targets: dict[str, tuple[KVTarget, ...]] = {}
        self._active: dict[str, list[SendHandle]] = {}  # a request's sends, one per target
        self._step: list[tuple[SendHandle, range]] = []  # this step's sends and their blocks
        self._in_step: set[str] = set()
        self._results = ResultMailbox()  # what take_result() hands out
        self._finished: list[str] = []

    @property
    def sender(self) -> KVSender:
        """The sender streaming the registered pool (exists once the pool is registered)."""
        if self._sender is None:
            raise RuntimeError("no KV pool registered with the connector yet")
        return self._sender

    @property
    def has_window_pool(self) -> bool:
        """Whether the engine registered a window pool: every request then needs a
        ``window_target`` too."""
        return self._window is not None

    def open_handles(self) -> list[str]:
        """Request ids with a send still open, over both pools (for leak checks)."""
        window = self._window.open_handles() if self._window is not None else []
        own = self._sender.open_handles() if self._sender is not None else []
        return sorted(set(own) | set(window))

    # ---- serving-layer side
    def register_target(
        self,
        request_id: str,
        target: KVTarget | Sequence[KVTarget],
        *,
        window_target: KVTarget | Sequence[KVTarget] | None = None,
    ) -> None:
        """Say where request ``request_id``'s KV goes (call before adding the request): one
        target, or one per rank of a tensor-parallel decode replica; with a window pool
        registered, ``window_target`` (required then: one, or one per decode rank) is where
        its window blocks go."""
        if (window_target is None) != (self._window is None):
            raise ValueError(
                "window_target: required exactly when the engine registered a window pool "
                f"(this connector {'has' if self._window else 'has none'})"
            )
        targets = (target,) if isinstance(target, KVTarget) else tuple(target)
        if not targets:
            raise ValueError(f"target: no KVTarget given for request {request_id!r}")
        for t in targets:
            if not isinstance(t, KVTarget):
                raise TypeError(f"target: expected KVTarget, got {type(t).__name__}")
            if t.request_id != request_id:
                raise ValueError(f"target.request_id: {t.request_id!r} differs from {request_id!r}")
        if self._window is not None and window_target is not None:
            self._window.register_target(request_id, window_target)
        with self._lock:
            self._targets[request_id] = targets

    def unregister_target(self, request_id: str) -> None:
        with self._lock:
            self._targets.pop(request_id, None)
        if self._window is not None:
            self._window.unregister_target(request_id)

    def take_result(self, request_id: str, timeout: float | None = None) -> TransferResult | None:
        """The request's transfer result once it ended (waits up to ``timeout``)."""
        result = self._results.take(request_id, timeout)
        if self._window is None or result is None:
            return result
        window = self._window.take_result(request_id, timeout)
        if window is None:  # the full pool's transfer ended, the window pool's not yet
            window = TransferResult(
                request_id=request_id,
                ok=False,
                bytes=0,
                seconds=0.0,
                error="the window pool's transfer had not ended",
            )
        return merge_results(request_id, [result, window])

    def close(self) -> None:
        """Close the sender's connections (idempotent; nothing to do before a pool)."""
        if self._sender is not None:
            self._sender.close()
        if self._window is not None:
            self._window.close()

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
        if self._sender is not None:
            raise RuntimeError("a KV pool is already registered with this connector")
        layout = registered_layout(kv_cache, model_name, layout, kv_scales=kv_scales)
        self._sender = KVSender(
            layout,
            self.config,
            device=kv_cache.device.type,
            observer=self.observer,
        )

    def register_window_kv_caches(
        self,
        window_kv_cache: torch.Tensor,
        model_name: str,
        *,
        layers: tuple[int, ...],
        window: int,
        kv_scales: torch.Tensor | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        """The engine's window pool (``WindowKVConnector``; an int8 / float8 pool's
        ``[L_window, 2, H]`` scales), streamed by a connector of its own under the identity
        ``window_identity(model_name, window)``. A tensor-parallel rank passes ``layout``
        (its heads of the window pool, under that identity)."""
        if not self.moves_window_pool:
            raise ValueError("a window pool needs PrefillKVConnector(window_pool=True)")
        if self._window is not None:
            raise RuntimeError("a window pool is already registered with this connector")
        identity = window_identity(model_name, window)
        if layout is not None and layout.model != identity:
            raise ValueError(f"layout: model {layout.model!r}, expected {identity!r}")
        total = self.sender.layout.num_layers + len(layers)
        members = set(layers)
        if len(members) != len(layers) or not members <= set(range(total)):
            raise ValueError(f"layers: {layers} are not distinct layers of {total}")
        full = [i for i in range(total) if i not in members]
        self._layer_map = [
            (True, layers.index(i)) if i in members else (False, full.index(i))
            for i in range(total)
        ]
        self._window = PrefillKVConnector(self.config, observer=self.observer)
        self._window.register_kv_caches(
            window_kv_cache, identity, layout=layout, kv_scales=kv_scales
        )

    def begin_step(self, sends: list[PendingSend]) -> None:
        if self._window is not None:
            self._window.begin_step([_window_part(s) for s in sends])
        self._begin_own(sends)

    def _begin_own(self, sends: list[PendingSend]) -> None:
        step: list[tuple[SendHandle, range]] = []
        for send in sends:
            rid = send.request_id
            with self._lock:
                pending = self._targets.get(rid)
                handles = self._active.get(rid)
            if send.cancel:
                self._cancel(rid)
            elif handles is not None:
                trimmed = _trim_held(send, handles[0].target.first_block)
                if trimmed is not None:
                    step += self._continue(trimmed)
            elif pending is not None or send.first:
                trimmed = _trim_held(send, pending[0].first_block if pending else 0)
                if trimmed is not None:  # else the decode side holds every block so far
                    step += self._begin(trimmed)
        with self._lock:
            self._step = step
            self._in_step = {s.request_id for s in sends}

    def _begin(self, send: PendingSend) -> list[tuple[SendHandle, range]]:
        """The request's first blocks: open its transfer."""
        with self._lock:
            targets = self._targets.pop(send.request_id, None)
        if targets is None:
            self._settle_now(send.request_id, "no KVTarget registered for this request")
            return []
        try:
            opened = self._open_sends(send, targets)
        except (ValueError, KVTransferError) as exc:
            self._settle_now(send.request_id, str(exc))
            return []
        if not opened:  # e.g. a replica copy of the heads: the canonical rank sends
            self._settle_now(send.request_id, None)
            return []
        with self._lock:
            self._active[send.request_id] = opened
        return [(h, range(len(h.src_block_ids))) for h in opened]

    def _continue(self, send: PendingSend) -> list[tuple[SendHandle, range]]:
        """A later chunk's blocks: add them to the request's open sends."""
        with self._lock:
            handles = self._active.get(send.request_id)
        if handles is None:
            return []  # its transfer already ended (failed), and was reported then
        try:
            spans = []
            for handle in handles:
                if send.block_offset != len(handle.src_block_ids):
                    raise ValueError(
                        f"blocks from {send.block_offset} announced, but "
                        f"{len(handle.src_block_ids)} were sent before"
                    )
                spans.append(self.sender.extend(handle, send.block_ids))
        except ValueError as exc:
            for handle in handles:
                self.sender.abort(handle, f"bad chunk of request {send.request_id!r}: {exc}")
            return []
        return list(zip(handles, spans, strict=True))

    def _cancel(self, request_id: str) -> None:
        """The request left before its final chunk: end its sends, tell the decode side."""
        reason = "the request left the prefill engine before its last chunk"
        with self._lock:
            unopened = self._targets.pop(request_id, None)
            handles = self._active.get(request_id, [])
        for handle in handles:
            self.sender.abort(handle, reason)
        if unopened is not None:
            # Every block announced so far was one the decode side holds: nothing was sent,
            # but the engine still waits to hear that the request's blocks are free.
            self._settle_now(request_id, reason)

    def _open_sends(self, send: PendingSend, targets: tuple[KVTarget, ...]) -> list[SendHandle]:
        """One send per target that gets heads from this pool (checks every target first:
        sizes, layouts, and that every head this pool sends has a target)."""
        layout = self.sender.layout
        slices = []
        if len({t.first_block for t in targets}) != 1:
            raise ValueError(
                f"targets: the ranks hold different prefixes (first_block "
                f"{[t.first_block for t in targets]}); they share one block table"
            )
        for target in targets:
            needed = math.ceil(send.num_tokens / target.layout.block_size) - target.first_block
            if needed != len(target.block_ids):
                raise ValueError(
                    f"the target has {len(target.block_ids)} blocks for {send.num_tokens} "
                    f"tokens past its first {target.first_block} blocks ({needed} blocks)"
                )
            slices.append(tp_plan.send_slice(layout, target.layout))  # raises on mismatch
        covered = {h for s in slices if s is not None for h in s.heads}
        missing = [h for h in layout.canonical_heads if h not in covered]
        if missing:
            raise ValueError(
                f"targets: none holds heads {missing} of this pool ({layout.describe_heads()}); "
                f"the targets hold {[t.layout.describe_heads() for t in targets]}"
            )
        opened: list[SendHandle] = []
        try:
            for target, heads in zip(targets, slices, strict=True):
                if heads is not None:
                    opened.append(self.sender.open(target, list(send.block_ids)))
        except (ValueError, KVTransferError) as exc:
            for handle in opened:  # the request failed: its other sends stop too
                self.sender.fail(handle, KVTransferError(f"another send of the request: {exc}"))
            raise
        return opened

    def layer_computed(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        if self._layer_map is not None:  # kv_cache is the layer's own tensor then
            in_window, layer_idx = self._layer_map[layer_idx]
            if in_window:
                assert self._window is not None
                self._window.layer_computed(layer_idx, kv_cache)
                return
        for handle, span in self._step:
            self.sender.send_layer(handle, layer_idx, kv_cache, span)

    def end_step(self) -> list[str]:
        # Requests begun in this step are reported from the next poll on: the engine only
        # starts tracking them as "sending" once the step's outputs are processed.
        with self._lock:
            begun, self._in_step = self._in_step, set()
            self._step = []
        own = self._collect(exclude=begun)
        return self._both_halves(own, self._window.end_step() if self._window else None)

    def poll_finished(self) -> list[str]:
        own = self._collect(exclude=set())
        return self._both_halves(own, self._window.poll_finished() if self._window else None)

    def _both_halves(self, own: list[str], window: list[str] | None) -> list[str]:
        """With a window pool, the requests whose full-pool and window transfers have both
        ended (each half reports a request once)."""
        if window is None:
            return own
        done = []
        for rid in own + window:
            if self._halves.pop(rid, 0):
                done.append(rid)
            else:
                self._halves[rid] = 1
        return done

    def _collect(self, exclude: set[str]) -> list[str]:
        now = time.time()
        with self._lock:
            active = list(self._active.values())
        for sends in active:  # one send failed: the request failed, its others stop too
            if any(h.done() and h.error is not None for h in sends):
                for h in sends:
                    self.sender.abort(h, "another send of the request failed")
        with self._lock:
            # A send past its deadline is over even if the peer never answered (finish()
            # below then fails it at once): the engine must get its blocks back.
            done = {
                rid: sends
                for rid, sends in self._active.items()
                if all(h.done() or now > h.target.deadline for h in sends)
            }
            for rid in done:
                del self._active[rid]
        for rid, sends in done.items():
            # Blocks may be freed now: every write into the peers has completed or stopped.
            results = [self.sender.finish(h, check=False) for h in sends]
            self._record(rid, merge_results(rid, results))
        with self._lock:
            finished = [rid for rid in self._finished if rid not in exclude]
            self._finished = [rid for rid in self._finished if rid in exclude]
        return finished

    def _settle_now(self, request_id: str, error: str | None) -> None:
        """Settle a request that sends nothing: failed with ``error``, or (None) ok."""
        self._record(
            request_id,
            TransferResult(
                request_id=request_id, ok=error is None, bytes=0, seconds=0.0, error=error
            ),
        )

    def _record(self, request_id: str, result: TransferResult) -> None:
        self._results.put(request_id, result)
        with self._lock:
            self._finished.append(request_id)


def _trim_held(send: PendingSend, held: int) -> PendingSend | None:
    """The part of a step's send that the decode side lacks: its blocks from prompt block
    ``held`` on, with ``block_offset`` counted from there (the blocks of the transfer);
    None when the decode side holds all of them."""
    drop = max(0, held - send.block_offset)
    if drop >= len(send.block_ids):
        return None
    return dataclasses.replace(
        send, block_ids=send.block_ids[drop:], block_offset=send.block_offset + drop - held
    )


def window_identity(model_name: str, window: int) -> str:
    """The identity a window pool's blocks are sent under (the decode side's window pool
    registers the same): never confused with a pool of every layer."""
    return f"{model_name} (window layers, last {window} tokens)"


def _window_part(send: PendingSend) -> PendingSend:
    """The window pool's side of a step's send: the same blocks' window table entries
    (the target's ``first_block`` then drops those the window no longer reaches)."""
    if send.cancel:
        return send
    if send.window_block_ids is None or len(send.window_block_ids) != len(send.block_ids):
        raise ValueError(
            f"request {send.request_id!r}: the engine announced no window table entries for "
            "its blocks, but registered a window pool"
        )
    return dataclasses.replace(send, block_ids=list(send.window_block_ids), window_block_ids=None)
