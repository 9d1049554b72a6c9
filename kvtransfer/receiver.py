"""Decode side of a KV hand-off: reserve-and-expect, then wait for the bytes to land.

``KVReceiver`` owns a control listener (bound to the cluster-internal address) and the table
of expected requests. A prefill peer connects once, proves its pool layout matches, and then
opens requests by id and token, each for a share of this pool's KV heads (the ranks of a
tensor-parallel prefill replica each send the heads they hold; shares must not overlap: a
head landing twice fails the request). A share arrives in layer messages that each carry
a run of the request's blocks (a prompt prefilled in chunks is sent chunk by chunk), so
accounting is per block and layer: every block of every layer of every head of this pool
must land exactly once, with exactly the expected bytes, before ``wait`` reports the
request complete (a block sent twice for the same heads fails it). A sender that gives a
request up (``wire.Abort``: aborted or preempted on the prefill side) fails it at once.
Every outcome releases the request's entry; a cancelled or timed-out request is fenced (its
senders confirm they have stopped writing) before ``wait``/``cancel`` return, so the caller
may reuse its blocks.
It never allocates or frees engine blocks itself.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import secrets
import socket
import threading
import time

import torch

from pdserve.kernels.ops import prepare_copy_thread
from pdserve.kvtransfer import blocks, gpu_ids, wire
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.metrics import TransferObserver, notify
from pdserve.kvtransfer.node import (
    cupy_installed,
    local_node_id,
    receive_transports,
    receiver_offer,
)
from pdserve.kvtransfer.receiver_state import HeadShare, PeerConn, Session
from pdserve.kvtransfer.shm import ShmSegment
from pdserve.kvtransfer.transport import TransportUnavailableError
from pdserve.kvtransfer.types import (
    KVLayout,
    KVTarget,
    KVTransferError,
    KVTransferTimeoutError,
    TransferResult,
)

log = logging.getLogger(__name__)


class KVReceiver:
    """Accepts KV writes from prefill peers into ``kv_cache`` [L, P, N, B, H, D].

    ``shm_segment``: the shared segment holding ``kv_cache`` (from ``SharedKVAllocator``),
    needed to offer the shared-memory transport.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        config: KVTransferConfig | None = None,
        *,
        shm_segment: ShmSegment | None = None,
        observer: TransferObserver | None = None,
    ) -> None:
        blocks.check_pool(kv_cache, layout)
        self.kv_cache = kv_cache
        self.layout = layout
        self.config = config or KVTransferConfig()
        self.node_id = local_node_id(self.config.node_id)
        self._observer = observer
        self._device = kv_cache.device.type
        self.transport = receiver_offer(
            self.config.transport,
            self._device,
            shm_segment is not None,
            ipc_capable=self._device == "cuda" and cupy_installed(),
        )
        # The pool's GPU by identity: peers map it by UUID, never by index.
        self.gpu = gpu_ids.gpu_key(kv_cache.device.index or 0) if self._device == "cuda" else None
        if self.transport == "shm" and shm_segment is None:
            raise ValueError("transport: 'shm' needs the pool's shm_segment (SharedKVAllocator)")
        if self.transport == "shm" and self._device != "cpu":
            raise ValueError("transport: 'shm' needs a CPU pool")
        # Every transport a peer may ask for; the pool is exported over CUDA IPC only when
        # this receiver offers it (that is the one place CuPy gets imported).
        self._transports = receive_transports(self, shm_segment, self.transport)
        self._num_blocks = kv_cache.shape[2]
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._conns: set[PeerConn] = set()
        self._closed = False
        self._listener = socket.create_server((self.config.host, 0), backlog=64)
        host, port = self._listener.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kv-recv-accept-{port}", daemon=True
        )
        self._accept_thread.start()

    # ------------------------------------------------------------------ public API

    def expect(
        self,
        request_id: str,
        block_ids: list[int] | tuple[int, ...],
        deadline: float | None = None,
        *,
        num_tokens: int | None = None,
        first_block: int = 0,
    ) -> KVTarget:
        """Register a request whose KV will be written into ``block_ids`` (prompt order).

        With ``num_tokens`` only the blocks holding that many tokens are expected: an
        engine's reservation may also hold room for the tokens it will generate.
        ``first_block`` > 0: ``block_ids`` receive the prompt's blocks from that one on
        (this side holds the ones before; ``num_tokens`` still counts the whole prompt)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if first_block < 0:
            raise ValueError(f"first_block: must be >= 0, got {first_block}")
        if num_tokens is not None:
            if num_tokens <= 0:
                raise ValueError(f"num_tokens: must be positive, got {num_tokens}")
            needed = math.ceil(num_tokens / self.layout.block_size) - first_block
            block_ids = block_ids[: max(0, needed)]
        ids = tuple(int(b) for b in block_ids)
        if not ids:
            raise ValueError("block_ids: must not be empty")
        bad = [b for b in ids if not 0 <= b < self._num_blocks]
        if bad:
            raise ValueError(
                f"block_ids: {bad[:8]} out of range for a pool of {self._num_blocks} blocks"
            )
        if len(set(ids)) != len(ids):
            raise ValueError("block_ids: contains duplicates")
        now = time.time()
        deadline = now + self.config.default_deadline_s if deadline is None else deadline
        if deadline <= now:
            raise ValueError(f"deadline: {deadline} is in the past (now {now:.3f})")
        session = Session(
            request_id=request_id,
            token=secrets.token_urlsafe(24),
            block_ids=ids,
            block_index=torch.tensor(ids, dtype=torch.int64, device=self.kv_cache.device),
            deadline=deadline,
            num_layers=self.layout.num_layers,
            heads=self.layout.kv_heads,
        )
        with self._lock:
            if self._closed:
                raise KVTransferError("receiver is closed")
            if request_id in self._sessions:
                raise ValueError(f"request_id: {request_id!r} is already expected")
            self._sessions[request_id] = session
        return KVTarget(
            transport=self.transport,
            address=self.address,
            node_id=self.node_id,
            request_id=request_id,
            block_ids=ids,
            first_block=first_block,
            deadline=deadline,
            token=session.token,
            layout=self.layout,
            gpu=self.gpu,
        )

    def wait(self, request_id: str, deadline: float | None = None) -> TransferResult:
        """Block until the request's KV landed completely (returns) or failed / missed the
        deadline (raises ``KVTransferError`` / ``KVTransferTimeoutError``). Either way the
        request is no longer expected afterwards."""
        with self._lock:
            session = self._sessions.get(request_id)
        if session is None:
            raise KVTransferError(f"request {request_id!r} is not expected")
        deadline = session.deadline if deadline is None else deadline
        session.done.wait(timeout=max(0.0, deadline - time.time()))
        with session.lock:
            if session.state in ("expected", "open"):
                self._set_final(
                    session,
                    "cancelled",
                    f"transfer missed its deadline ({session.state}: {session.progress()})",
                )
                timed_out = True
            else:
                timed_out = False
        result = self._release(session)
        if result.ok:
            return result
        if timed_out:
            raise KVTransferTimeoutError(f"request {request_id!r}: {result.error}")
        raise KVTransferError(f"request {request_id!r}: {result.error}")

    def cancel(self, request_id: str) -> None:
        """Stop expecting a request (idempotent); returns once no peer writes its blocks."""
        with self._lock:
            session = self._sessions.get(request_id)
        if session is None:
            return
        with session.lock:
            if session.state in ("expected", "open"):
                self._set_final(session, "cancelled", "cancelled by the decode side")
        self._release(session)

    def pending(self) -> list[str]:
        """Request ids still expected (for leak checks)."""
        with self._lock:
            return sorted(self._sessions)

    def landed_blocks(self, request_id: str) -> int | None:
        """(layer, block) pairs of the request landed so far, over every head share (None:
        not expected): a prompt sent chunk by chunk lands while it is still prefilled."""
        with self._lock:
            session = self._sessions.get(request_id)
        if session is None:
            return None
        with session.lock:
            return sum(s.num_landed for s in session.shares.values())

    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        """Stop listening, drop every peer and fail every pending request."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
            sessions = list(self._sessions.values())
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        with contextlib.suppress(OSError):
            self._listener.close()
        for conn in conns:
            conn.channel.close()
        for session in sessions:
            with session.lock:
                if session.state in ("expected", "open"):
                    self._set_final(session, "failed", "receiver closed")
        self._accept_thread.join(timeout=5)
        # Threads that outlive the interpreter would release tensors during its shutdown.
        for conn in conns:
            if conn.thread is not None:  # it ends the connection's transport state on exit
                conn.thread.join(timeout=5)

    # ------------------------------------------------------------------ internals

    def _set_final(self, session: Session, state: str, error: str | None) -> None:
        """Caller holds ``session.lock``."""
        session.state = state
        session.error = error
        session.done.set()

    def _release(self, session: Session) -> TransferResult:
        """Forget the session; fence a peer that might still write into its blocks."""
        with self._lock:
            if self._sessions.get(session.request_id) is session:
                del self._sessions[session.request_id]
        shares = list(session.shares.values())
        for share in shares:  # a share whose layers all landed writes nothing any more
            if session.state != "done" and not session.share_complete(share) and share.conn.alive:
                self._fence(share.conn, session.request_id)
        start = session.opened if session.opened is not None else session.created
        names = sorted({s.conn.transport_name for s in shares})
        result = TransferResult(
            request_id=session.request_id,
            ok=session.state == "done",
            bytes=session.bytes,
            seconds=max(0.0, time.perf_counter() - start),
            error=session.error,
            transport="+".join(names) if names else self.transport,
            layer_messages=session.messages,
        )
        notify(self._observer, "recv", result)
        return result

    def _fence(self, conn: PeerConn, request_id: str) -> None:
        conn.transport.fence(conn, request_id)

    def bind_device(self) -> None:
        """Set up an I/O thread: copies on this thread only; the CUDA device is per thread,
        point it at the pool's GPU."""
        prepare_copy_thread()
        if self.kv_cache.device.type == "cuda":
            torch.cuda.set_device(self.kv_cache.device)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            conn = PeerConn(wire.Channel(sock))
            with self._lock:
                if self._closed:
                    conn.channel.close()
                    return
                self._conns.add(conn)
            conn.thread = threading.Thread(
                target=self._serve, args=(conn,), name=f"kv-recv-{conn.channel.peer}", daemon=True
            )
            conn.thread.start()

    def _serve(self, conn: PeerConn) -> None:
        self.bind_device()
        try:
            if self._handshake(conn):
                self._serve_messages(conn)
        except Exception as exc:  # noqa: BLE001 - a broken peer must not kill the receiver
            log.warning("KV peer %s dropped: %s", conn.channel.peer, exc)
        finally:
            self._on_disconnect(conn)

    def _handshake(self, conn: PeerConn) -> bool:
        hello = conn.channel.recv()
        if not isinstance(hello, wire.Hello):
            conn.send(wire.Error(code="protocol", message="expected hello"))
            return False
        mismatch = self.layout.mismatch(hello.layout)
        if mismatch is not None:
            conn.send(
                wire.Error(
                    code="layout_mismatch",
                    message=f"KV layout mismatch (local=decode, peer=prefill): {mismatch}",
                )
            )
            return False
        transport = self._transports.get(hello.transport)
        if transport is None:
            conn.send(wire.Error(code="transport", message=f"unknown {hello.transport!r}"))
            return False
        try:
            reach = transport.export(conn, hello)
        except TransportUnavailableError as exc:
            conn.send(wire.Error(code="transport", message=str(exc)))
            return False
        conn.transport = transport
        conn.layout = hello.layout
        conn.send(
            wire.HelloOk(
                transport=hello.transport,
                pool_shape=tuple(self.kv_cache.shape),
                pool_dtype=self.layout.dtype,
                **reach,
            )
        )
        transport.accept(conn)
        return True

    def _serve_messages(self, conn: PeerConn) -> None:
        while True:
            msg = conn.channel.recv()
            if msg is None:
                return
            if isinstance(msg, wire.Open):
                self._on_open(conn, msg)
            elif isinstance(msg, wire.Layer):
                self._on_layer(conn, msg)
            elif isinstance(msg, wire.Abort):
                self._on_abort(conn, msg)
            elif isinstance(msg, wire.CancelAck):
                conn.on_ack(msg.request_id)
            else:
                conn.send(wire.Error(code="protocol", message=f"unexpected {msg.kind!r}"))
                return

    def _on_open(self, conn: PeerConn, msg: wire.Open) -> None:
        def refuse(why: str) -> None:
            conn.send(wire.Error(code="refused", message=why, request_id=msg.request_id))

        with self._lock:
            session = self._sessions.get(msg.request_id)
        if session is None:
            return refuse(f"unknown request id {msg.request_id!r}")
        if not hmac.compare_digest(session.token.encode(), msg.token.encode()):
            return refuse(f"wrong token for request {msg.request_id!r}")
        heads = range(msg.head_start, msg.head_start + msg.num_heads)
        with session.lock:
            if session.state not in ("expected", "open"):
                return refuse(f"request {msg.request_id!r} is {session.state}, not expected")
            if time.time() > session.deadline:
                return refuse(f"request {msg.request_id!r} is past its deadline")
            if msg.num_blocks != len(session.block_ids):
                return refuse(
                    f"num_blocks: sender has {msg.num_blocks} blocks, "
                    f"receiver expects {len(session.block_ids)}"
                )
            problem = self._heads_problem(conn, heads)
            if problem is not None:
                return refuse(f"request {msg.request_id!r}: {problem}")
            twice = self._heads_twice(session, conn, heads)
            if twice is not None:  # an authenticated peer broke the protocol: end it all
                refuse(twice)
                if session.state in ("expected", "open"):
                    self._set_final(session, "failed", twice)
                return None
            session.shares[conn] = HeadShare(
                conn=conn, heads=heads, block_bytes=self.layout.block_bytes(len(heads))
            )
            session.state = "open"
            if session.opened is None:
                session.opened = time.perf_counter()
        conn.send(
            wire.OpenOk(
                request_id=msg.request_id,
                block_ids=session.block_ids,
                head_offset=heads.start - self.layout.kv_head_start,
            )
        )
        return None

    def _heads_problem(self, conn: PeerConn, heads: range) -> str | None:
        """Why a peer may not write ``heads`` (global) into this pool, if it may not."""
        mine, peer = self.layout.kv_heads, conn.layout
        assert peer is not None  # set by the handshake
        if heads.start < mine.start or heads.stop > mine.stop:
            return (
                f"heads [{heads.start}, {heads.stop}) are not all held by this pool "
                f"({self.layout.describe_heads()})"
            )
        if peer.kv_head_replica:
            return f"the prefill pool ({peer.describe_heads()}) is a replica copy: it never sends"
        if heads.start < peer.kv_head_start or heads.stop > peer.kv_head_start + peer.num_kv_heads:
            return (
                f"heads [{heads.start}, {heads.stop}) are not all held by the prefill pool "
                f"({peer.describe_heads()})"
            )
        return None

    def _heads_twice(self, session: Session, conn: PeerConn, heads: range) -> str | None:
        """The protocol violation if ``heads`` were already opened (caller holds the lock)."""
        for share in session.shares.values():
            overlap = [h for h in heads if h in share.heads]
            if overlap:
                who = (
                    "this peer" if share.conn is conn else f"prefill peer {share.conn.channel.peer}"
                )
                return (
                    f"heads {overlap} of request {session.request_id!r} were already opened by "
                    f"{who} (heads [{share.heads.start}, {share.heads.stop})): a KV head "
                    "would land twice"
                )
        return None

    def _on_layer(self, conn: PeerConn, msg: wire.Layer) -> None:
        with self._lock:
            session = self._sessions.get(msg.request_id)
        problem = self._layer_problem(conn, session, msg)
        if problem is None:
            assert session is not None
            announced = session.shares[conn].announced.setdefault(msg.layer, set())
            announced.update(_span(msg))  # only this connection's thread
        conn.transport.land(conn, session if problem is None else None, msg)
        if problem is not None:
            conn.send(wire.Error(code="refused", message=problem, request_id=msg.request_id))
            if session is not None and conn in session.shares:
                with session.lock:
                    if session.state == "open":
                        self._set_final(session, "failed", problem)

    def _layer_problem(
        self, conn: PeerConn, session: Session | None, msg: wire.Layer
    ) -> str | None:
        share = None if session is None else session.shares.get(conn)
        if session is None or share is None:
            return f"layer for request {msg.request_id!r} that this peer has not opened"
        if session.state != "open":
            return f"request {msg.request_id!r} is {session.state}"
        if not 0 <= msg.layer < self.layout.num_layers:
            return f"layer {msg.layer} out of range [0, {self.layout.num_layers})"
        heads = range(msg.head_start, msg.head_start + msg.num_heads)
        if heads != share.heads:
            return (
                f"layer {msg.layer}: heads [{heads.start}, {heads.stop}), but this peer opened "
                f"[{share.heads.start}, {share.heads.stop})"
            )
        span = _span(msg)
        if span.stop > len(session.block_ids):
            return (
                f"layer {msg.layer}: blocks [{span.start}, {span.stop}) run past the "
                f"request's {len(session.block_ids)} blocks"
            )
        twice = [b for b in span if b in share.announced.get(msg.layer, ())]
        if twice:
            return (
                f"layer {msg.layer} (heads [{heads.start}, {heads.stop})) of blocks "
                f"{twice[:8]} of request {msg.request_id!r} sent twice"
            )
        expected = len(span) * share.block_bytes
        if msg.nbytes != expected:
            return (
                f"layer {msg.layer}: {msg.nbytes} bytes for {len(span)} blocks, expected {expected}"
            )
        if time.time() > session.deadline:
            return f"layer {msg.layer} of request {msg.request_id!r} arrived past the deadline"
        return None

    def record_layer(self, conn: PeerConn, session: Session, msg: wire.Layer) -> None:
        """Count a landed layer of some blocks of the peer's share: once every block of
        every layer of the share landed it is confirmed to the peer; the session completes
        once every head's share is. Caller holds ``session.lock``."""
        share = session.shares[conn]
        landed = share.landed.setdefault(msg.layer, set())
        span = _span(msg)
        assert landed.isdisjoint(span), "a block landed twice (headers are checked)"
        landed.update(span)
        share.num_landed += len(span)
        share.messages += 1
        session.messages += 1
        share.bytes += msg.nbytes
        session.bytes += msg.nbytes
        if not session.share_complete(share):
            return
        conn.send(wire.Done(request_id=session.request_id, ok=True, bytes=share.bytes))
        if session.complete():
            self._set_final(session, "done", None)

    def fail_session(self, session: Session, error: str) -> None:
        """Caller holds ``session.lock``."""
        self._set_final(session, "failed", error)

    def _on_disconnect(self, conn: PeerConn) -> None:
        conn.alive = False
        conn.channel.close()
        if conn.transport is not None:  # layers already received still land first
            conn.transport.disconnect(conn)
        with self._lock:
            self._conns.discard(conn)
            sessions = [s for s in self._sessions.values() if conn in s.shares]
        for session in sessions:
            with session.lock:
                share = session.shares[conn]
                if session.state == "open" and not session.share_complete(share):
                    self._set_final(
                        session,
                        "failed",
                        f"prefill peer {conn.channel.peer} went away: "
                        f"{session.share_progress(share)}",
                    )

    def _on_abort(self, conn: PeerConn, msg: wire.Abort) -> None:
        """The peer gave the request up (it no longer writes it): fail the request."""
        with self._lock:
            session = self._sessions.get(msg.request_id)
        if session is None or conn not in session.shares:
            return  # already over here, or never opened by this peer
        with session.lock:
            if session.state == "open":
                self._set_final(
                    session,
                    "failed",
                    f"prefill peer {conn.channel.peer} aborted the transfer ({msg.reason}): "
                    f"{session.progress()}",
                )


def _span(msg: wire.Layer) -> range:
    """The request's blocks a layer message carries (indices into its block list)."""
    return range(msg.block_start, msg.block_start + msg.num_blocks)
