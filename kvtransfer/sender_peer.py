"""One decode peer as seen from the prefill side, and the handle of one request's send.

A ``DecodePeer`` owns the control connection to one decode endpoint plus the transport state
(mapped shared-memory or CUDA IPC pool, or a torch.distributed pair group), a worker thread
that performs the queued opens and layer writes in order, and a reader thread that applies
the peer's answers (grants, completions, cancels, refusals) to the handles. Outcomes are
settled through the owning ``KVSender``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pdserve.kvtransfer import blocks, torchdist, wire
from pdserve.kvtransfer.shm import ShmSegment
from pdserve.kvtransfer.staging import BufferPool, Scratch, typed_view
from pdserve.kvtransfer.threads import single_threaded_copies
from pdserve.kvtransfer.types import (
    KVLayoutMismatchError,
    KVTarget,
    KVTransferError,
    KVTransferRefusedError,
    KVTransferTimeoutError,
    TransferResult,
)

if TYPE_CHECKING:
    from pdserve.kvtransfer.sender import KVSender

log = logging.getLogger(__name__)


@dataclass
class SendHandle:
    """One request's transfer on the prefill side."""

    target: KVTarget
    src_block_ids: list[int]
    started: float = field(default_factory=time.perf_counter)
    dst_block_ids: list[int] = field(default_factory=list)
    bytes_sent: int = 0
    layers_sent: int = 0
    result: TransferResult | None = None
    error: KVTransferError | None = None
    opened: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    # Held while bytes are written straight into the peer's pool; a Cancel takes it, so
    # once the peer has our CancelAck no write for this request is in flight or to come.
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    _state_lock: threading.Lock = field(default_factory=threading.Lock)
    peer: DecodePeer | None = None

    @property
    def request_id(self) -> str:
        return self.target.request_id

    def done(self) -> bool:
        return self.finished.is_set()


class DecodePeer:
    """One decode peer: control channel, transport state, worker and reader threads."""

    def __init__(self, sender: KVSender, address: str, transport: str) -> None:
        self.sender = sender
        self.address = address
        self.transport = transport
        self.jobs: queue.Queue[tuple[str, SendHandle, Any] | None] = queue.Queue()
        self.handles: dict[str, SendHandle] = {}
        self.lock = threading.Lock()
        self.dead: KVTransferError | None = None
        self.channel: wire.Channel | None = None
        self.group: torch.distributed.ProcessGroup | None = None
        self.store: torch.distributed.TCPStore | None = None
        self.backend = ""
        self.pool: torch.Tensor | None = None  # the peer's pool, mapped (shm / CUDA IPC)
        self.mapping: Any = None  # ShmSegment or cuda_ipc mapping, kept alive with ``pool``
        self.seq = 0
        self.inflight: collections.deque[tuple[Any, torch.Tensor, SendHandle]] = collections.deque()
        self.staging: BufferPool | None = None
        self.scratch = Scratch()  # worker thread only
        self.closed = False
        self.reader: threading.Thread | None = None
        self.worker = threading.Thread(target=self._work, name=f"kv-send-{address}", daemon=True)
        self.worker.start()

    # ------------------------------------------------------------- worker thread

    def _work(self) -> None:
        single_threaded_copies()
        device = self.sender.torch_device
        if device.type == "cuda" and device.index is not None:  # the device is per thread
            torch.cuda.set_device(device)
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                self._drain_inflight()  # idle: complete the sends still on the wire
                job = self.jobs.get()
            if job is None:
                self._drain_inflight()
                return
            kind, handle, arg = job
            if handle.done():
                continue
            try:
                if self.dead is not None:
                    raise self.dead
                if self.channel is None:
                    self._connect()
                if kind == "open":
                    self._open(handle)
                else:
                    self._send_layer(handle, *arg)
            except KVTransferError as exc:
                self.sender._fail(handle, exc)
                if self.dead is not None or self.channel is None:
                    self.sender._drop_peer(self, exc)
            except Exception as exc:  # noqa: BLE001 - socket/gloo errors end this peer
                err = KVTransferError(f"KV transfer to {self.address} failed: {exc}")
                self.sender._fail(handle, err)
                self.sender._drop_peer(self, err)

    def _connect(self) -> None:
        cfg = self.sender.config
        try:
            channel = wire.connect(self.address, cfg.connect_timeout_s)
        except OSError as exc:
            self.dead = KVTransferError(f"cannot reach decode peer {self.address}: {exc}")
            raise self.dead from exc
        channel.send(
            wire.Hello(
                layout=self.sender.layout,
                node_id=self.sender.node_id,
                transport=self.transport,
                device=self.sender.device,
            )
        )
        channel.sock.settimeout(cfg.connect_timeout_s)
        reply = channel.recv()
        channel.sock.settimeout(None)
        if isinstance(reply, wire.Error):
            channel.close()
            cls = KVLayoutMismatchError if reply.code == "layout_mismatch" else KVTransferError
            self.dead = cls(reply.message)
            raise self.dead
        if not isinstance(reply, wire.HelloOk):
            channel.close()
            self.dead = KVTransferError(f"decode peer {self.address} did not answer hello")
            raise self.dead
        try:
            self._setup_transport(reply)
        except Exception as exc:
            channel.close()
            self.dead = KVTransferError(
                f"cannot set up {reply.transport} with decode peer {self.address}: {exc}"
            )
            raise self.dead from exc
        self.channel = channel
        self.reader = threading.Thread(
            target=self._read, name=f"kv-send-read-{self.address}", daemon=True
        )
        self.reader.start()

    def _setup_transport(self, reply: wire.HelloOk) -> None:
        """Map the peer's pool (shm, CUDA IPC) or build the pair's group (torch_dist)."""
        cfg = self.sender.config
        host = wire.parse_address(self.address)[0]
        if reply.transport == "shm":
            assert reply.shm_name is not None
            size = math.prod(reply.pool_shape) * self._elem_size(reply.pool_dtype)
            seg = ShmSegment.attach(reply.shm_name, size)
            self.mapping = seg
            self.pool = seg.tensor(reply.pool_shape, getattr(torch, reply.pool_dtype))
        elif reply.transport == "cuda_ipc":
            from pdserve.kvtransfer import cuda_ipc

            assert reply.ipc_handle is not None
            self.mapping = cuda_ipc.open_pool(
                reply.ipc_handle, reply.pool_shape, getattr(torch, reply.pool_dtype)
            )
            self.pool = self.mapping.tensor
        elif reply.transport == "torch_dist":
            assert reply.store_port is not None and reply.backend is not None
            self.backend = reply.backend
            self.store = torchdist.store_client(host, reply.store_port, cfg.connect_timeout_s)
            self.group = torchdist.pair_group(
                self.store, torchdist.SENDER_RANK, reply.backend, cfg.host, cfg.connect_timeout_s
            )

    @staticmethod
    def _elem_size(dtype: str) -> int:
        return torch.empty((), dtype=getattr(torch, dtype)).element_size()

    def _open(self, handle: SendHandle) -> None:
        assert self.channel is not None
        t = handle.target
        self.channel.send(
            wire.Open(request_id=t.request_id, token=t.token, num_blocks=len(t.block_ids))
        )
        # Writes go straight into the peer's blocks: only after the peer granted them.
        if not handle.opened.wait(max(0.0, t.deadline - time.time())):
            raise KVTransferTimeoutError(f"request {t.request_id!r}: open not granted in time")

    def _send_layer(
        self, handle: SendHandle, layer: int, src: torch.Tensor, ready: Any | None
    ) -> None:
        t = handle.target
        assert self.channel is not None
        if time.time() > t.deadline:
            raise KVTransferTimeoutError(
                f"request {t.request_id!r}: deadline passed before layer {layer}"
            )
        nbytes = len(handle.src_block_ids) * t.layout.block_bytes()
        if self.transport == "torch_dist":
            assert self.group is not None
            if ready is not None:  # a CUDA event recorded when the layer was computed
                torch.cuda.current_stream(src.device).wait_event(ready)
            # At most two layers in flight per peer: gather the next while one is on the wire.
            while len(self.inflight) >= 2:
                self._reap_oldest()
            staging = self.staging or BufferPool(2, "cpu" if self.backend == "gloo" else src.device)
            self.staging = staging
            flat = staging.take(nbytes, timeout=1.0)
            n = len(handle.src_block_ids)
            buf = typed_view(flat, (*src.shape[:-4], n, *src.shape[-3:]), src.dtype)
            if src.device == buf.device:
                blocks.copy_blocks(src, handle.src_block_ids, buf, list(range(n)))
            else:  # CUDA pool over gloo: gather on the GPU, then one copy to the host
                buf.copy_(blocks.gather(src, self.sender.index(handle.src_block_ids, src.device)))
            self.seq += 1
            self.channel.send(
                wire.Layer(request_id=t.request_id, layer=layer, nbytes=nbytes, seq=self.seq)
            )
            work = self.group.send([buf], torchdist.RECEIVER_RANK, torchdist.tag_of(self.seq))
            self.inflight.append((work, flat, handle))
        else:
            assert self.pool is not None
            with handle.write_lock:
                if handle.done():  # cancelled while we waited for the lock
                    return
                if ready is None:
                    blocks.copy_blocks(
                        src,
                        handle.src_block_ids,
                        self.pool[layer],
                        handle.dst_block_ids,
                        self.scratch,
                    )
                else:  # CUDA IPC: copy on a side stream once the layer is computed
                    stream = self.mapping.copy_stream
                    with torch.cuda.stream(stream):
                        stream.wait_event(ready)
                        blocks.copy_blocks(
                            src, handle.src_block_ids, self.pool[layer], handle.dst_block_ids
                        )
                    stream.synchronize()
            self.channel.send(wire.Layer(request_id=t.request_id, layer=layer, nbytes=nbytes))
        handle.bytes_sent += nbytes
        handle.layers_sent += 1

    def _reap_oldest(self) -> None:
        work, flat, handle = self.inflight.popleft()
        try:
            torchdist.wait(work, max(1.0, handle.target.deadline - time.time()))
        finally:
            assert self.staging is not None
            self.staging.give(flat)

    def _drain_inflight(self) -> None:
        while self.inflight:
            handle = self.inflight[0][2]
            try:
                self._reap_oldest()
            except Exception as exc:  # noqa: BLE001 - the pair is broken: end this peer
                err = KVTransferError(f"KV transfer to {self.address} failed: {exc}")
                self.sender._fail(handle, err)
                self.sender._drop_peer(self, err)
                self.inflight.clear()

    # ------------------------------------------------------------- reader thread

    def _read(self) -> None:
        channel = self.channel
        assert channel is not None
        while True:
            try:
                msg = channel.recv()
            except Exception as exc:  # noqa: BLE001 - a garbled stream ends the peer
                msg = None
                log.warning("bad message from decode peer %s: %s", self.address, exc)
            if msg is None:
                self.sender._drop_peer(
                    self, KVTransferError(f"decode peer {self.address} went away")
                )
                return
            handle = self.handles.get(getattr(msg, "request_id", None) or "")
            if isinstance(msg, wire.OpenOk) and handle is not None:
                handle.dst_block_ids = list(msg.block_ids)
                handle.opened.set()
            elif isinstance(msg, wire.Done) and handle is not None:
                if msg.ok:
                    self.sender._succeed(handle, msg.bytes)
                else:
                    self.sender._fail(handle, KVTransferError(msg.error or "transfer failed"))
            elif isinstance(msg, wire.Cancel):
                if handle is not None:
                    with handle.write_lock:
                        self.sender._fail(
                            handle, KVTransferError("transfer cancelled by the decode side")
                        )
                with contextlib.suppress(OSError):
                    channel.send(wire.CancelAck(request_id=msg.request_id))
            elif isinstance(msg, wire.Error):
                err = KVTransferRefusedError(msg.message)
                if msg.request_id is None:
                    self.sender._drop_peer(self, err)
                    return
                if handle is not None:
                    self.sender._fail(handle, err)

    def join(self, timeout: float) -> None:
        """Wait for the worker and reader threads to end (after ``close``). Threads that
        outlive the interpreter would release tensors during its shutdown and abort it."""
        for thread in (self.worker, self.reader):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)

    def close(self) -> None:
        """Idempotent; may race between the reader thread and ``KVSender.close``."""
        with self.lock:
            channel, self.channel = self.channel, None
            group, self.group, self.store = self.group, None, None
            mapping, self.mapping, self.pool = self.mapping, None, None
            first = not self.closed
            self.closed = True
        if channel is not None:
            channel.close()
        if first:
            self.jobs.put(None)
        torchdist.shutdown(group, self.backend)
        # Attached shm segments are never unlinked by an attacher; CUDA IPC maps are closed.
        if mapping is not None and not isinstance(mapping, ShmSegment):
            mapping.close()
