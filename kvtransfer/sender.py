"""Prefill side of a KV hand-off: stream each computed layer of a request to its decode peer.

A tensor-parallel rank sends each decode pool (one per decode rank) only the KV heads both
hold, and only if it holds the canonical copy (``tp_plan``).

``KVSender.open(target, src_block_ids)`` and ``send_layer`` only enqueue work and return at
once, so the model keeps computing the next layer while this one moves; a worker thread per
decode peer does the I/O in order (one message per layer per request and call: the blocks
written are coalesced, never sent one by one) and a reader thread per peer collects the
peer's answers. A prompt prefilled in chunks is sent chunk by chunk: ``open`` with the
blocks the first chunk completes, ``extend`` with each later chunk's, and ``send_layer``
with the span of blocks to write (the receiver completes once every block of every layer
landed). ``abort`` gives a transfer up and tells the decode side.
``finish`` waits for the decode side's confirmation, bounded by the target's deadline.
The sender never frees engine blocks; it reports when it is done with them
(``SendHandle.finished``).
"""

from __future__ import annotations

import threading
import time

import torch

from pdserve.kvtransfer import gpu_ids, tp_plan
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.metrics import TransferObserver, notify
from pdserve.kvtransfer.node import cupy_installed, local_node_id, send_transport, sender_choice
from pdserve.kvtransfer.send_handle import SendHandle
from pdserve.kvtransfer.sender_peer import DecodePeer
from pdserve.kvtransfer.tp_plan import HeadSlice
from pdserve.kvtransfer.types import (
    KVLayout,
    KVTarget,
    KVTransferError,
    KVTransferRefusedError,
    KVTransferTimeoutError,
    TransferResult,
)


class KVSender:
    """Pushes requests' KV, layer by layer, into decode peers' reserved blocks.

    ``device`` is where this engine's pool lives ('cpu', 'cuda' or 'cuda:N').
    """

    def __init__(
        self,
        layout: KVLayout,
        config: KVTransferConfig | None = None,
        *,
        device: str = "cpu",
        observer: TransferObserver | None = None,
    ) -> None:
        self.layout = layout
        self.config = config or KVTransferConfig()
        self.torch_device = torch.device(device)
        if self.torch_device.type == "cuda" and self.torch_device.index is None:
            # Resolve "cuda" now, on the engine's thread: the I/O threads must use its GPU.
            # (torch's stubs type device.index as int; it is None for a bare "cuda".)
            self.torch_device = torch.device("cuda", torch.cuda.current_device())  # type: ignore[unreachable]
        self.device = self.torch_device.type
        self.node_id = local_node_id(self.config.node_id)
        self._observer = observer
        self._lock = threading.Lock()
        self._peers: dict[tuple[str, str], DecodePeer] = {}
        self._retired: list[DecodePeer] = []
        self._ipc_capable = self.device == "cuda" and cupy_installed()
        self._gpus: list[gpu_ids.GpuId] | None = None  # the GPUs this process sees

    def open(self, target: KVTarget, src_block_ids: list[int]) -> SendHandle:
        """Start a transfer of the request's KV from ``src_block_ids`` (prompt order; only
        the first ``len(target.block_ids)`` are sent; a prompt sent in chunks passes the
        first chunk's blocks and ``extend``s later): the heads this pool holds canonically
        that the target's pool holds (``tp_plan.send_slice``; ValueError when there are
        none). Never blocks on the network."""
        src = [int(b) for b in src_block_ids[: len(target.block_ids)]]
        if not src:
            raise ValueError("src_block_ids: no block to send")
        if any(b < 0 for b in src):
            raise ValueError("src_block_ids: negative block id")
        same_node = target.node_id == self.node_id
        peer_gpu = self._peer_gpu_local(target) if same_node else None
        transport = sender_choice(
            self.config.transport,
            target.transport,
            same_node,
            self.device,
            peer_gpu_local=peer_gpu,
            ipc_capable=self._ipc_capable,
        )
        handle = SendHandle(target=target, src_block_ids=src, heads=self._head_slice(target))
        with self._lock:
            key = (target.address, transport)
            peer = self._peers.get(key)
            if peer is None or peer.dead is not None:
                peer = DecodePeer(
                    self,
                    target.address,
                    send_transport(transport, self.config, peer_gpu_local=peer_gpu),
                )
                self._peers[key] = peer
            if target.request_id in peer.handles:
                raise ValueError(f"request_id: {target.request_id!r} is already being sent")
            handle.peer = peer
            peer.handles[target.request_id] = handle
            peer.jobs.put(("open", handle, None))
        return handle

    def _head_slice(self, target: KVTarget) -> HeadSlice:
        """The heads of this pool that go to the target's pool (ValueError: none do)."""
        if self.layout.mismatch(target.layout) is not None:
            # The pools cannot be paired; the decode side refuses at the handshake, naming
            # both sides' values (its own layout, not the target's, is the one that counts).
            return HeadSlice(self.layout.kv_head_start, self.layout.num_kv_heads, 0, 0)
        heads = tp_plan.send_slice(self.layout, target.layout)
        if heads is None:
            raise ValueError(
                f"target: the decode pool holds {target.layout.describe_heads()}, none of "
                f"which this pool ({self.layout.describe_heads()}) sends"
            )
        return heads

    def _peer_gpu_local(self, target: KVTarget) -> int | None:
        """This process's index of the target pool's GPU (None: not visible here)."""
        if self.device != "cuda" or target.gpu is None:
            return None
        if self._gpus is None:
            self._gpus = gpu_ids.visible_gpus()
        return gpu_ids.local_index(target.gpu, self._gpus)

    def extend(self, handle: SendHandle, src_block_ids: list[int]) -> range:
        """Add the request's next blocks (a later chunk completed them); returns their span
        (indices into the request's blocks) for ``send_layer``. ValueError past the
        target's blocks."""
        src = [int(b) for b in src_block_ids]
        start = len(handle.src_block_ids)
        if start + len(src) > len(handle.target.block_ids):
            raise ValueError(
                f"src_block_ids: {start + len(src)} blocks sent, the target expects "
                f"{len(handle.target.block_ids)}"
            )
        if any(b < 0 for b in src):
            raise ValueError("src_block_ids: negative block id")
        handle.src_block_ids.extend(src)  # read by the worker only at spans enqueued later
        return range(start, start + len(src))

    def send_layer(
        self,
        handle: SendHandle,
        layer_idx: int,
        kv_cache: torch.Tensor,
        span: range | None = None,
    ) -> None:
        """Enqueue layer ``layer_idx`` of the request's blocks ``span`` (indices into its
        blocks; default: every block known so far) as one message; ``kv_cache`` is the
        whole pool [L, P, N, B, H, D] or that layer [P, N, B, H, D]. Returns at once."""
        if handle.done():
            return
        if span is None:
            span = range(len(handle.src_block_ids))
        if not span or span.step != 1 or span.start < 0 or span.stop > len(handle.src_block_ids):
            raise ValueError(
                f"span: {span} is not a run of the request's {len(handle.src_block_ids)} blocks"
            )
        src = kv_cache[layer_idx] if kv_cache.dim() == 6 else kv_cache
        top = max(handle.src_ids(span))
        if top >= src.shape[1]:
            self.fail(
                handle,
                KVTransferRefusedError(
                    f"src_block_ids: {top} out of range for a pool of {src.shape[1]} blocks"
                ),
            )
            return
        ready = None
        if src.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(src.device))
        assert handle.peer is not None
        handle.peer.jobs.put(("layer", handle, (layer_idx, src, ready, span)))

    def abort(self, handle: SendHandle, reason: str) -> None:
        """Give the transfer up: after the writes already enqueued, the decode side is told
        (it fails the request) and the handle fails. Returns at once; ``handle.finished``
        is set once no write of it is in flight."""
        if handle.done() or handle.abort_requested:
            return
        handle.abort_requested = True
        assert handle.peer is not None
        handle.peer.jobs.put(("abort", handle, reason))

    def finish(self, handle: SendHandle, *, check: bool = True) -> TransferResult:
        """Wait (until the target's deadline) for the decode side to confirm every layer.

        Raises the transfer's error when ``check`` (the default); else returns the result
        with ``ok=False``."""
        # The decode side gives up at the deadline too; waiting longer frees nothing sooner.
        remaining = handle.target.deadline - time.time()
        if not handle.finished.wait(max(0.0, remaining)):
            self.fail(
                handle,
                KVTransferTimeoutError(
                    f"request {handle.request_id!r}: no confirmation by the deadline "
                    f"({handle.layers_sent} layer messages sent over "
                    f"{len(handle.src_block_ids)}/{len(handle.target.block_ids)} blocks, "
                    f"{self.layout.num_layers} layers)"
                ),
            )
        assert handle.result is not None
        if check and handle.error is not None:
            raise handle.error
        return handle.result

    def open_handles(self) -> list[str]:
        """Request ids with a transfer still in progress (for leak checks)."""
        with self._lock:
            return sorted(rid for p in self._peers.values() for rid in p.handles)

    def close(self) -> None:
        """Fail what is in flight, disconnect every peer and wait for their threads."""
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            self.drop_peer(peer, KVTransferError("sender closed"))
        with self._lock:
            retired, self._retired = self._retired, []
        for peer in retired:
            peer.join(timeout=5.0)

    # ------------------------------------------------------------- internals

    # The three below are called by the peers' threads (sender_peer.PeerOwner).
    def succeed(self, handle: SendHandle, nbytes: int) -> None:
        self._settle(handle, None, nbytes)

    def fail(self, handle: SendHandle, error: KVTransferError) -> None:
        self._settle(handle, error, handle.bytes_sent)

    def _settle(self, handle: SendHandle, error: KVTransferError | None, nbytes: int) -> None:
        with handle.state_lock:
            if handle.finished.is_set():
                return
            handle.error = error
            handle.result = TransferResult(
                request_id=handle.request_id,
                ok=error is None,
                bytes=nbytes,
                seconds=time.perf_counter() - handle.started,
                error=None if error is None else str(error),
                transport=handle.peer.transport.name if handle.peer else "",
                layer_messages=handle.layers_sent,
            )
            handle.opened.set()
            handle.finished.set()
        if handle.peer is not None:
            with self._lock:
                if handle.peer.handles.get(handle.request_id) is handle:
                    del handle.peer.handles[handle.request_id]
        notify(self._observer, "send", handle.result)

    def drop_peer(self, peer: DecodePeer, error: KVTransferError) -> None:
        """The peer is gone (or unusable): fail its transfers and tear its state down."""
        with self._lock:
            if peer.dead is None:
                peer.dead = error
            for key, p in list(self._peers.items()):
                if p is peer:
                    del self._peers[key]
            if peer not in self._retired:  # joined by close(); finished ones are pruned
                self._retired = [p for p in self._retired if p.worker.is_alive()] + [peer]
            handles = list(peer.handles.values())
        for handle in handles:
            self.fail(handle, error)
        peer.close()
