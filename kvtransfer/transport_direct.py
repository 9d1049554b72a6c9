"""Direct-write transports for two engines on one node: shared memory (CPU pools) and CUDA
IPC (GPU pools, through CuPy, imported only when this transport is used).

The decode side exports its whole pool once; the prefill side maps it and copies a
request's blocks straight into the reserved ones, then announces the layer. A cancel is
fenced: the receiver waits for the sender's ``CancelAck``, which the sender sends only once
it holds the request's ``write_lock`` (so no copy for it is running or will start).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import torch

from pdserve.kvtransfer import blocks, wire
from pdserve.kvtransfer.receiver_state import PeerConn, Session
from pdserve.kvtransfer.send_handle import SendHandle
from pdserve.kvtransfer.shm import ShmSegment
from pdserve.kvtransfer.staging import Scratch
from pdserve.kvtransfer.transport import (
    LandingSite,
    ReceiveTransport,
    SendTransport,
    TransportUnavailableError,
)

log = logging.getLogger(__name__)


class _DirectSend(SendTransport):
    """Copies into the peer's mapped pool; subclasses say how the pool is mapped."""

    def __init__(self) -> None:
        self.pool: torch.Tensor | None = None  # the peer's pool, mapped into this process
        self.mapping: Any = None  # keeps the mapping alive as long as ``pool``
        self.scratch = Scratch()  # worker thread only
        self.copy_lock = threading.Lock()

    def write_layer(
        self,
        handle: SendHandle,
        layer: int,
        src: torch.Tensor,
        ready: Any | None,
        channel: wire.Channel,
        span: range | None = None,
    ) -> bool:
        t = handle.target
        h = handle.heads
        span = range(len(handle.src_block_ids)) if span is None else span
        src_ids, dst_ids = handle.src_ids(span), handle.dst_ids(span)
        # ``copy_lock`` spans every copy into the mapping: ``close`` takes it, so a mapping
        # is never unmapped under a copy in flight (a sticky CUDA error on GPUs).
        with handle.write_lock, self.copy_lock:
            pool = self.pool
            if handle.done() or pool is None:  # cancelled, or the peer was dropped
                return False
            # Only the send's heads, from/to where each pool holds them.
            src = blocks.heads(src, h.src_start, h.num_heads)
            dst = blocks.heads(pool[layer], handle.dst_head_start, h.num_heads)
            if ready is None:
                blocks.copy_blocks(src, src_ids, dst, dst_ids, self.scratch)
            else:  # CUDA IPC: copy on a side stream once the layer is computed
                stream = self.mapping.copy_stream
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    _copy_cuda(src, src_ids, dst, dst_ids)
                stream.synchronize()
        handle.count_layer(span)
        channel.send(
            wire.Layer(
                request_id=t.request_id,
                layer=layer,
                nbytes=handle.span_bytes(span),
                head_start=h.first_head,
                num_heads=h.num_heads,
                block_start=span.start,
                num_blocks=len(span),
            )
        )
        return True


def _copy_cuda(
    src: torch.Tensor,  # [2, N_src, B, h, D], maybe a head slice
    src_ids: list[int],
    dst: torch.Tensor,  # [2, N_dst, B, h, D], maybe a head slice, maybe on a peer GPU
    dst_ids: list[int],
) -> None:
    """Blocks ``src_ids`` of ``src`` into blocks ``dst_ids`` of ``dst``."""
    if src.device == dst.device:
        blocks.copy_blocks(src, src_ids, dst, dst_ids)
        return
    ids = torch.tensor(src_ids, dtype=torch.int64, device=src.device)
    staged = blocks.gather(src, ids).to(dst.device, non_blocking=True)
    dst_index = torch.tensor(dst_ids, dtype=torch.int64, device=dst.device)
    blocks.scatter(staged, dst, dst_index)


class ShmSend(_DirectSend):
    name = "shm"

    def open(self, reply: wire.HelloOk, peer_host: str) -> None:
        assert reply.shm_name is not None
        elem = torch.empty((), dtype=getattr(torch, reply.pool_dtype)).element_size()
        seg = ShmSegment.attach(reply.shm_name, math.prod(reply.pool_shape) * elem)
        self.mapping = seg
        self.pool = seg.tensor(reply.pool_shape, getattr(torch, reply.pool_dtype))

    def close(self) -> None:
        # An attacher never unlinks the segment; the mapping goes with the last view.
        with self.copy_lock:
            self.mapping, self.pool = None, None


class CudaIpcSend(_DirectSend):
    """Maps the peer's pool on ``device``: this process's index of the peer's GPU (found
    by UUID / PCI bus id; it may differ from the index the peer itself uses)."""

    name = "cuda_ipc"

    def __init__(self, device: int) -> None:
        super().__init__()
        self.device = device

    def open(self, reply: wire.HelloOk, peer_host: str) -> None:
        from pdserve.kvtransfer import cuda_ipc  # cupy is imported lazily, only here

        assert reply.ipc_handle is not None
        self.mapping = cuda_ipc.open_pool(
            reply.ipc_handle, reply.pool_shape, getattr(torch, reply.pool_dtype), self.device
        )
        self.pool = self.mapping.tensor

    def close(self) -> None:
        # Under the copy lock, and after the copy stream drained: no copy is in flight
        # (nor will start: ``pool`` is None) when the mapping goes away.
        with self.copy_lock:
            mapping, self.mapping, self.pool = self.mapping, None, None
            if mapping is not None:
                mapping.copy_stream.synchronize()
                mapping.close()


class _DirectReceive(ReceiveTransport):
    """Layers are already in the pool when their header arrives: count them."""

    def __init__(self, site: LandingSite) -> None:
        self.site = site

    def land(self, conn: PeerConn, session: Session | None, msg: wire.Layer) -> None:
        if session is None:
            return
        with session.lock:
            if session.state == "open":
                self.site.record_layer(conn, session, msg)

    def fence(self, conn: PeerConn, request_id: str) -> None:
        # The sender writes straight into our blocks: only its word says it has stopped.
        acked = conn.ack_event(request_id)
        if conn.send(wire.Cancel(request_id=request_id)) and not acked.wait(
            self.site.config.cancel_fence_s
        ):
            log.warning(
                "prefill peer %s did not confirm it stopped writing %s; dropping it",
                conn.channel.peer,
                request_id,
            )
            conn.channel.close()
        conn.drop_ack(request_id)


class ShmReceive(_DirectReceive):
    """Offers the pool's shared-memory segment (None: the pool is not in one)."""

    name = "shm"

    def __init__(self, site: LandingSite, segment: ShmSegment | None) -> None:
        super().__init__(site)
        self.segment = segment

    def export(self, conn: PeerConn, hello: wire.Hello) -> dict[str, Any]:
        if self.segment is None:
            raise TransportUnavailableError("this pool is not in shm")
        return {"shm_name": self.segment.name}


class CudaIpcReceive(_DirectReceive):
    """Offers the pool's CUDA IPC handle (exported once, when the pool offers cuda_ipc)."""

    name = "cuda_ipc"

    def __init__(self, site: LandingSite, export_pool: bool) -> None:
        super().__init__(site)
        self.export_pool = export_pool
        self.handle: str | None = None
        self._lock = threading.Lock()

    def export(self, conn: PeerConn, hello: wire.Hello) -> dict[str, Any]:
        if not self.export_pool:
            raise TransportUnavailableError("this pool is not exported")
        with self._lock:  # exported once, when the first peer chooses CUDA IPC
            if self.handle is None:
                from pdserve.kvtransfer import cuda_ipc  # cupy is imported only here

                self.handle = cuda_ipc.export_handle(self.site.kv_cache)
        return {"ipc_handle": self.handle}
