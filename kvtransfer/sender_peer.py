"""One decode peer as seen from the prefill side.

A ``DecodePeer`` owns the control connection to one decode endpoint plus its transport
(a ``pdserve.kvtransfer.transport.SendTransport``: a mapped shared-memory or CUDA IPC pool,
or a torch.distributed pair group), a worker thread that performs the queued opens and layer
writes in order, and a reader thread that applies the peer's answers (grants, completions,
cancels, refusals) to the handles. Outcomes are settled through its ``PeerOwner`` (the
``KVSender``), which this module knows only by that protocol.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any, Protocol

import torch

from pdserve.kernels.ops import prepare_copy_thread
from pdserve.kvtransfer import wire
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.send_handle import SendHandle
from pdserve.kvtransfer.transport import SendTransport
from pdserve.kvtransfer.types import (
    KVLayout,
    KVLayoutMismatchError,
    KVTransferError,
    KVTransferRefusedError,
    KVTransferTimeoutError,
)

log = logging.getLogger(__name__)


class PeerOwner(Protocol):
    """What a ``DecodePeer`` needs of the sender that owns it."""

    config: KVTransferConfig
    layout: KVLayout
    node_id: str
    device: str  # 'cpu' or 'cuda': the prefill pool's device type
    torch_device: torch.device

    def succeed(self, handle: SendHandle, nbytes: int) -> None:
        """The decode side confirmed every layer of the handle."""

    def fail(self, handle: SendHandle, error: KVTransferError) -> None:
        """The handle's transfer failed (no-op if it already ended)."""

    def drop_peer(self, peer: DecodePeer, error: KVTransferError) -> None:
        """The peer is unusable: fail its transfers and close it."""


class DecodePeer:
    """One decode peer: control channel, transport state, worker and reader threads."""

    def __init__(self, owner: PeerOwner, address: str, transport: SendTransport) -> None:
        self.owner = owner
        self.address = address
        self.transport = transport
        self.jobs: queue.Queue[tuple[str, SendHandle, Any] | None] = queue.Queue()
        self.handles: dict[str, SendHandle] = {}
        self.lock = threading.Lock()
        self.dead: KVTransferError | None = None
        self.channel: wire.Channel | None = None
        self.closed = False
        self.reader: threading.Thread | None = None
        self.worker = threading.Thread(target=self._work, name=f"kv-send-{address}", daemon=True)
        self.worker.start()

    # ------------------------------------------------------------- worker thread

    def _work(self) -> None:
        prepare_copy_thread()
        device = self.owner.torch_device
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
                elif kind == "abort":
                    self._abort(handle, arg)
                else:
                    self._send_layer(handle, *arg)
            except KVTransferError as exc:
                self.owner.fail(handle, exc)
                if self.dead is not None or self.channel is None:
                    self.owner.drop_peer(self, exc)
            except Exception as exc:  # noqa: BLE001 - socket/gloo errors end this peer
                err = KVTransferError(f"KV transfer to {self.address} failed: {exc}")
                self.owner.fail(handle, err)
                self.owner.drop_peer(self, err)

    def _connect(self) -> None:
        cfg = self.owner.config
        try:
            channel = wire.connect(self.address, cfg.connect_timeout_s)
        except OSError as exc:
            self.dead = KVTransferError(f"cannot reach decode peer {self.address}: {exc}")
            raise self.dead from exc
        channel.send(
            wire.Hello(
                layout=self.owner.layout,
                node_id=self.owner.node_id,
                transport=self.transport.name,
                device=self.owner.device,
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
            self.transport.open(reply, wire.parse_address(self.address)[0])
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

    def _open(self, handle: SendHandle) -> None:
        assert self.channel is not None
        t = handle.target
        self.channel.send(
            wire.Open(
                request_id=t.request_id,
                token=t.token,
                num_blocks=len(t.block_ids),
                head_start=handle.heads.first_head,
                num_heads=handle.heads.num_heads,
            )
        )
        # Writes go straight into the peer's blocks: only after the peer granted them.
        if not handle.opened.wait(max(0.0, t.deadline - time.time())):
            raise KVTransferTimeoutError(f"request {t.request_id!r}: open not granted in time")

    def _send_layer(
        self, handle: SendHandle, layer: int, src: torch.Tensor, ready: Any | None, span: range
    ) -> None:
        t = handle.target
        assert self.channel is not None
        if time.time() > t.deadline:
            raise KVTransferTimeoutError(
                f"request {t.request_id!r}: deadline passed before layer {layer} of blocks "
                f"[{span.start}, {span.stop})"
            )
        self.transport.write_layer(handle, layer, src, ready, self.channel, span)

    def _abort(self, handle: SendHandle, reason: str) -> None:
        """Every earlier write of the handle is done (jobs run in order): fail it, so no
        write follows, then tell the decode side."""
        assert self.channel is not None
        with handle.write_lock:
            self.owner.fail(handle, KVTransferError(f"aborted by the prefill side: {reason}"))
        self.channel.send(wire.Abort(request_id=handle.request_id, reason=reason))

    def _drain_inflight(self) -> None:
        try:
            self.transport.drain()
        except Exception as exc:  # noqa: BLE001 - the pair is broken: end this peer
            self.owner.drop_peer(
                self, KVTransferError(f"KV transfer to {self.address} failed: {exc}")
            )

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
                self.owner.drop_peer(self, KVTransferError(f"decode peer {self.address} went away"))
                return
            handle = self.handles.get(getattr(msg, "request_id", None) or "")
            if isinstance(msg, wire.OpenOk) and handle is not None:
                handle.dst_block_ids = list(msg.block_ids)
                handle.dst_head_start = msg.head_offset
                handle.opened.set()
            elif isinstance(msg, wire.Done) and handle is not None:
                if msg.ok:
                    self.owner.succeed(handle, msg.bytes)
                else:
                    self.owner.fail(handle, KVTransferError(msg.error or "transfer failed"))
            elif isinstance(msg, wire.Cancel):
                if handle is not None:
                    with handle.write_lock:
                        self.owner.fail(
                            handle, KVTransferError("transfer cancelled by the decode side")
                        )
                with contextlib.suppress(OSError):
                    channel.send(wire.CancelAck(request_id=msg.request_id))
            elif isinstance(msg, wire.Error):
                err = KVTransferRefusedError(msg.message)
                if msg.request_id is None:
                    self.owner.drop_peer(self, err)
                    return
                if handle is not None:
                    self.owner.fail(handle, err)

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
            first = not self.closed
            self.closed = True
        if channel is not None:
            channel.close()
        if first:
            self.jobs.put(None)
            self.transport.close()
