"""torch.distributed transport: NCCL between GPUs, gloo between CPU processes (or a CUDA
pool staged through the host), one two-rank group per prefill/decode connection.

The sender gathers a request's blocks of one layer into a staging buffer, sends the layer
header on the control channel and the buffer point-to-point, tagged with the header's
sequence number; up to two layers are in flight per connection. The receiver posts the
matching receive as soon as the header arrives, and a landing thread per connection waits
for it and scatters the bytes into the reserved blocks, so the next layer is already being
received while the previous one lands. A refused header's bytes are still received (and
dropped) to keep the pair in step.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kvtransfer import blocks, torchdist, wire
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.receiver_state import PeerConn, Session
from pdserve.kvtransfer.send_handle import SendHandle
from pdserve.kvtransfer.staging import BufferPool, typed_view
from pdserve.kvtransfer.transport import LandingSite, ReceiveTransport, SendTransport
from pdserve.kvtransfer.types import KVTransferError

log = logging.getLogger(__name__)


class TorchDistSend(SendTransport):
    """Prefill side of one pair."""

    name = "torch_dist"

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.group: torch.distributed.ProcessGroup | None = None
        self.store: torch.distributed.TCPStore | None = None
        self.backend = ""
        self.seq = 0
        self.inflight: collections.deque[tuple[Any, torch.Tensor, SendHandle]] = collections.deque()
        self.staging: BufferPool | None = None
        self._index_cache: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}

    def open(self, reply: wire.HelloOk, peer_host: str) -> None:
        assert reply.store_port is not None and reply.backend is not None
        cfg = self.config
        self.backend = reply.backend
        self.store = torchdist.store_client(peer_host, reply.store_port, cfg.connect_timeout_s)
        self.group = torchdist.pair_group(
            self.store, torchdist.SENDER_RANK, reply.backend, cfg.host, cfg.connect_timeout_s
        )

    def write_layer(
        self,
        handle: SendHandle,
        layer: int,
        src: torch.Tensor,
        ready: Any | None,
        channel: wire.Channel,
        span: range | None = None,
    ) -> bool:
        group = self.group
        assert group is not None
        t = handle.target
        h = handle.heads
        span = range(len(handle.src_block_ids)) if span is None else span
        src_ids = handle.src_ids(span)
        nbytes = handle.span_bytes(span)
        src = blocks.heads(src, h.src_start, h.num_heads)  # only the send's heads
        if ready is not None:  # a CUDA event recorded when the layer was computed
            torch.cuda.current_stream(src.device).wait_event(ready)
        # At most two layers in flight per peer: gather the next while one is on the wire.
        while len(self.inflight) >= 2:
            self._reap_oldest()
        staging = self.staging or BufferPool(2, "cpu" if self.backend == "gloo" else src.device)
        self.staging = staging
        flat = staging.take(nbytes, timeout=1.0)
        n = len(src_ids)
        buf = typed_view(flat, (*src.shape[:-4], n, *src.shape[-3:]), src.dtype)
        if src.device == buf.device:
            blocks.copy_blocks(src, src_ids, buf, list(range(n)))
        else:  # CUDA pool over gloo: gather on the GPU, then one copy to the host
            buf.copy_(blocks.gather(src, self._index(src_ids, src.device)))
        self.seq += 1
        handle.count_layer(span)
        channel.send(
            wire.Layer(
                request_id=t.request_id,
                layer=layer,
                nbytes=nbytes,
                head_start=h.first_head,
                num_heads=h.num_heads,
                block_start=span.start,
                num_blocks=n,
                seq=self.seq,
            )
        )
        work = group.send([buf], torchdist.RECEIVER_RANK, torchdist.tag_of(self.seq))
        self.inflight.append((work, flat, handle))
        return True

    def drain(self) -> None:
        try:
            while self.inflight:
                self._reap_oldest()
        except Exception:
            self.inflight.clear()  # the pair is broken: nothing more will complete
            raise

    def close(self) -> None:
        group, self.group, self.store = self.group, None, None
        torchdist.shutdown(group, self.backend)

    def _reap_oldest(self) -> None:
        work, flat, handle = self.inflight.popleft()
        try:
            torchdist.wait(work, max(1.0, handle.target.deadline - time.time()))
        finally:
            assert self.staging is not None
            self.staging.give(flat)

    def _index(self, ids: list[int], device: torch.device) -> torch.Tensor:
        key = (tuple(ids), str(device))
        idx = self._index_cache.get(key)
        if idx is None:
            if len(self._index_cache) > 1024:
                self._index_cache.clear()
            idx = self._index_cache[key] = torch.tensor(ids, dtype=torch.int64, device=device)
        return idx


@dataclass
class _Pair:
    """Decode side of one pair: its group, staging buffers and landing thread."""

    store: torch.distributed.TCPStore
    backend: str
    group: torch.distributed.ProcessGroup | None = None
    staging: BufferPool | None = None
    lander: threading.Thread | None = None
    # (session or None for a refused layer, header, staging buffer, recv work, timeout)
    landing: queue.Queue[tuple[Session | None, wire.Layer, torch.Tensor, Any, float] | None] = (
        field(default_factory=queue.Queue)
    )


class TorchDistReceive(ReceiveTransport):
    """Decode side: hosts each pair's store, receives layers, lands them on a thread."""

    name = "torch_dist"

    def __init__(self, site: LandingSite) -> None:
        self.site = site

    def export(self, conn: PeerConn, hello: wire.Hello) -> dict[str, Any]:
        cfg = self.site.config
        backend = torchdist.backend_for(hello.device, self.site.kv_cache.device.type)
        store = torchdist.store_master(cfg.host, cfg.connect_timeout_s)
        conn.link = _Pair(store=store, backend=backend)
        return {"store_port": store.port, "backend": backend}

    def accept(self, conn: PeerConn) -> None:
        pair: _Pair = conn.link
        cfg = self.site.config
        pair.group = torchdist.pair_group(
            pair.store, torchdist.RECEIVER_RANK, pair.backend, cfg.host, cfg.connect_timeout_s
        )
        pair.staging = BufferPool(2, self.site.kv_cache.device if pair.backend == "nccl" else "cpu")
        pair.lander = threading.Thread(
            target=self._land_loop, args=(conn,), name=f"kv-land-{conn.channel.peer}", daemon=True
        )
        pair.lander.start()

    def land(self, conn: PeerConn, session: Session | None, msg: wire.Layer) -> None:
        # The tensor is already on its way: always receive it to keep the pair in step,
        # and write it only if the header was valid and the request is still open.
        pair: _Pair = conn.link
        assert pair.group is not None and pair.staging is not None
        pool = self.site.kv_cache
        max_bytes = pool.shape[2] * self.site.layout.block_bytes()
        if not 0 < msg.nbytes <= max_bytes:
            raise KVTransferError(f"layer message of {msg.nbytes} bytes from a peer")
        timeout = self.site.config.connect_timeout_s
        if session is not None:
            timeout = max(1.0, session.deadline - time.time())
        # Post the receive and hand it to the landing thread, which waits for it and
        # scatters: the next layer's receive is posted while this one is in flight.
        flat = pair.staging.take(msg.nbytes, timeout)
        work = pair.group.recv(
            [flat[: msg.nbytes]], torchdist.SENDER_RANK, torchdist.tag_of(msg.seq)
        )
        pair.landing.put((session, msg, flat, work, timeout))

    def fence(self, conn: PeerConn, request_id: str) -> None:
        # Writes happen on our own landing thread under the session lock, which re-checks
        # the state: the peer need not confirm anything.
        conn.send(wire.Cancel(request_id=request_id))

    def disconnect(self, conn: PeerConn) -> None:
        pair: _Pair | None = conn.link
        if pair is None:
            return
        if pair.lander is not None:  # layers already received still land
            pair.landing.put(None)
            pair.lander.join(timeout=self.site.config.connect_timeout_s)
        torchdist.shutdown(pair.group, pair.backend)
        pair.group = None
        conn.link = None

    def _land_loop(self, conn: PeerConn) -> None:
        """Scatter received layers into the pool, in arrival order."""
        pair: _Pair = conn.link
        assert pair.staging is not None
        staging = pair.staging
        pool = self.site.kv_cache
        self.site.bind_device()
        while True:
            item = pair.landing.get()
            if item is None:
                return
            session, msg, flat, work, timeout = item
            try:
                torchdist.wait(work, timeout)
            except Exception as exc:  # noqa: BLE001 - the pair is broken: drop the peer
                log.warning("receive from KV peer %s failed: %s", conn.channel.peer, exc)
                staging.give(flat)
                conn.channel.close()  # the handler sees EOF and fails the open requests
                continue
            if session is None:  # a refused layer, drained to keep the pair in step
                staging.give(flat)
                continue
            try:
                with session.lock:
                    if session.state == "open":
                        # The header was checked against the peer's share of the heads.
                        first = msg.head_start - self.site.layout.kv_head_start
                        n, planes, (bs, _, dim) = msg.num_blocks, pool.shape[1], pool.shape[3:]
                        shape = (planes, n, bs, msg.num_heads, dim)
                        buf = typed_view(flat, shape, pool.dtype)
                        dst = blocks.heads(pool[msg.layer], first, msg.num_heads)
                        index = session.block_index[msg.block_start : msg.block_start + n]
                        blocks.scatter(buf.to(pool.device), dst, index)
                        self.site.record_layer(conn, session, msg)
            except Exception as exc:  # noqa: BLE001 - fail the request, keep the peer
                with session.lock:
                    if session.state == "open":
                        self.site.fail_session(session, f"writing layer failed: {exc}")
            finally:
                staging.give(flat)
