"""Decode side of a KV hand-off: reserve-and-expect, then wait for the bytes to land.

``KVReceiver`` owns a control listener (bound to the cluster-internal address) and the table
of expected requests. A prefill peer connects once, proves its pool layout matches, and then
opens requests by id and token; each opened request must deliver every layer exactly once,
with exactly the expected bytes, before ``wait`` reports it complete. Every outcome releases
the request's entry; a cancelled or timed-out request is fenced (the sender confirms it has
stopped writing) before ``wait``/``cancel`` return, so the caller may reuse its blocks.
It never allocates or frees engine blocks itself.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import socket
import threading
import time

import torch

from pdserve.kvtransfer import blocks, torchdist, wire
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.metrics import TransferObserver, notify
from pdserve.kvtransfer.node import local_node_id, receiver_offer
from pdserve.kvtransfer.receiver_state import PeerConn, Session
from pdserve.kvtransfer.shm import ShmSegment
from pdserve.kvtransfer.staging import BufferPool, typed_view
from pdserve.kvtransfer.threads import single_threaded_copies
from pdserve.kvtransfer.types import (
    KVLayout,
    KVTarget,
    KVTransferError,
    KVTransferTimeoutError,
    TransferResult,
)

log = logging.getLogger(__name__)


class KVReceiver:
    """Accepts KV writes from prefill peers into ``kv_cache`` [L, 2, N, B, H, D].

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
            self.config.transport, self._device, shm_segment is not None
        )
        if self.transport == "shm" and shm_segment is None:
            raise ValueError("transport: 'shm' needs the pool's shm_segment (SharedKVAllocator)")
        if self.transport == "shm" and self._device != "cpu":
            raise ValueError("transport: 'shm' needs a CPU pool")
        self._shm = shm_segment
        self._ipc_handle: str | None = None
        if self.transport == "cuda_ipc":
            from pdserve.kvtransfer import cuda_ipc  # cupy is imported lazily, only here

            self._ipc_handle = cuda_ipc.export_handle(kv_cache)
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
        self, request_id: str, block_ids: list[int] | tuple[int, ...], deadline: float | None = None
    ) -> KVTarget:
        """Register a request whose KV will be written into ``block_ids`` (prompt order)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
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
            layer_bytes=len(ids) * self.layout.block_bytes(),
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
            deadline=deadline,
            token=session.token,
            layout=self.layout,
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
                    session, "cancelled", f"transfer missed its deadline ({session.state})"
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
            for thread in (conn.thread, conn.lander):
                if thread is not None:
                    thread.join(timeout=5)

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
        conn = session.conn
        if session.state != "done" and conn is not None and conn.alive:
            self._fence(conn, session.request_id)
        start = session.opened if session.opened is not None else session.created
        result = TransferResult(
            request_id=session.request_id,
            ok=session.state == "done",
            bytes=session.bytes,
            seconds=max(0.0, time.perf_counter() - start),
            error=session.error,
            transport=conn.transport if conn is not None else self.transport,
        )
        notify(self._observer, "recv", result)
        return result

    def _fence(self, conn: PeerConn, request_id: str) -> None:
        # torch_dist writes happen on our own handler thread under the session lock, which
        # already re-checks the state; direct-write transports need the sender's word.
        if conn.transport == "torch_dist":
            conn.send(wire.Cancel(request_id=request_id))
            return
        acked = conn.ack_event(request_id)
        if conn.send(wire.Cancel(request_id=request_id)) and not acked.wait(
            self.config.cancel_fence_s
        ):
            log.warning(
                "prefill peer %s did not confirm it stopped writing %s; dropping it",
                conn.channel.peer,
                request_id,
            )
            conn.channel.close()
        conn.drop_ack(request_id)

    def _bind_device(self) -> None:
        """Set up an I/O thread: copies on this thread only; the CUDA device is per thread,
        point it at the pool's GPU."""
        single_threaded_copies()
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
        self._bind_device()
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
        ok = wire.HelloOk(
            transport=hello.transport,
            pool_shape=tuple(self.kv_cache.shape),
            pool_dtype=self.layout.dtype,
        )
        if hello.transport == "shm":
            if self._shm is None:
                conn.send(wire.Error(code="transport", message="this pool is not in shm"))
                return False
            ok = ok.model_copy(update={"shm_name": self._shm.name})
        elif hello.transport == "cuda_ipc":
            if self._ipc_handle is None:
                conn.send(wire.Error(code="transport", message="this pool is not exported"))
                return False
            ok = ok.model_copy(update={"ipc_handle": self._ipc_handle})
        elif hello.transport == "torch_dist":
            backend = torchdist.backend_for(hello.device, self._device)
            conn.store = torchdist.store_master(self.config.host, self.config.connect_timeout_s)
            ok = ok.model_copy(update={"store_port": conn.store.port, "backend": backend})
        else:
            conn.send(wire.Error(code="transport", message=f"unknown {hello.transport!r}"))
            return False
        conn.transport = hello.transport
        conn.send(ok)
        if conn.transport == "torch_dist":
            assert conn.store is not None and ok.backend is not None
            conn.backend = ok.backend
            conn.group = torchdist.pair_group(
                conn.store,
                torchdist.RECEIVER_RANK,
                ok.backend,
                self.config.host,
                self.config.connect_timeout_s,
            )
            staging_device = self.kv_cache.device if ok.backend == "nccl" else "cpu"
            conn.staging = BufferPool(2, staging_device)
            conn.lander = threading.Thread(
                target=self._land, args=(conn,), name=f"kv-land-{conn.channel.peer}", daemon=True
            )
            conn.lander.start()
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
        with session.lock:
            if session.state != "expected":
                return refuse(f"request {msg.request_id!r} is {session.state}, not expected")
            if time.time() > session.deadline:
                return refuse(f"request {msg.request_id!r} is past its deadline")
            if msg.num_blocks != len(session.block_ids):
                return refuse(
                    f"num_blocks: sender has {msg.num_blocks} blocks, "
                    f"receiver expects {len(session.block_ids)}"
                )
            session.state = "open"
            session.conn = conn
            session.opened = time.perf_counter()
        conn.send(wire.OpenOk(request_id=msg.request_id, block_ids=session.block_ids))

    def _on_layer(self, conn: PeerConn, msg: wire.Layer) -> None:
        with self._lock:
            session = self._sessions.get(msg.request_id)
        problem = self._layer_problem(conn, session, msg)
        if conn.transport == "torch_dist":
            # The tensor is already on its way: always receive it to keep the pair in step,
            # and write it only if the header was valid and the request is still open.
            assert conn.group is not None and conn.staging is not None
            max_bytes = self._num_blocks * self.layout.block_bytes()
            if not 0 < msg.nbytes <= max_bytes:
                raise KVTransferError(f"layer message of {msg.nbytes} bytes from a peer")
            timeout = self.config.connect_timeout_s
            if problem is None:
                assert session is not None
                session.announced.add(msg.layer)
                timeout = max(1.0, session.deadline - time.time())
            # Post the receive and hand it to the landing thread, which waits for it and
            # scatters: the next layer's receive is posted while this one is in flight.
            flat = conn.staging.take(msg.nbytes, timeout)
            work = conn.group.recv(
                [flat[: msg.nbytes]], torchdist.SENDER_RANK, torchdist.tag_of(msg.seq)
            )
            conn.landing.put((session if problem is None else None, msg, flat, work, timeout))
        elif problem is None:
            assert session is not None
            with session.lock:
                session.announced.add(msg.layer)
                if session.state == "open":
                    self._record_layer(conn, session, msg)
        if problem is not None:
            conn.send(wire.Error(code="refused", message=problem, request_id=msg.request_id))
            if session is not None and session.conn is conn:
                with session.lock:
                    if session.state == "open":
                        self._set_final(session, "failed", problem)

    def _land(self, conn: PeerConn) -> None:
        """torch_dist: scatter received layers into the pool, in arrival order."""
        assert conn.staging is not None
        self._bind_device()
        while True:
            item = conn.landing.get()
            if item is None:
                return
            session, msg, flat, work, timeout = item
            try:
                torchdist.wait(work, timeout)
            except Exception as exc:  # noqa: BLE001 - the pair is broken: drop the peer
                log.warning("receive from KV peer %s failed: %s", conn.channel.peer, exc)
                conn.staging.give(flat)
                conn.channel.close()  # the handler sees EOF and fails the open requests
                continue
            if session is None:  # a refused layer, drained to keep the pair in step
                conn.staging.give(flat)
                continue
            try:
                with session.lock:
                    if session.state == "open":
                        n = len(session.block_ids)
                        shape = (2, n, *self.kv_cache.shape[3:])
                        buf = typed_view(flat, shape, self.kv_cache.dtype)
                        blocks.scatter(
                            buf.to(self.kv_cache.device), self.kv_cache[msg.layer],
                            session.block_index,
                        )  # fmt: skip
                        self._record_layer(conn, session, msg)
            except Exception as exc:  # noqa: BLE001 - fail the request, keep the peer
                with session.lock:
                    if session.state == "open":
                        self._set_final(session, "failed", f"writing layer failed: {exc}")
            finally:
                conn.staging.give(flat)

    def _layer_problem(
        self, conn: PeerConn, session: Session | None, msg: wire.Layer
    ) -> str | None:
        if session is None or session.conn is not conn:
            return f"layer for request {msg.request_id!r} that this peer has not opened"
        if session.state != "open":
            return f"request {msg.request_id!r} is {session.state}"
        if not 0 <= msg.layer < self.layout.num_layers:
            return f"layer {msg.layer} out of range [0, {self.layout.num_layers})"
        if msg.layer in session.announced:
            return f"layer {msg.layer} of request {msg.request_id!r} sent twice"
        if msg.nbytes != session.layer_bytes:
            return f"layer {msg.layer}: {msg.nbytes} bytes, expected {session.layer_bytes}"
        if time.time() > session.deadline:
            return f"layer {msg.layer} of request {msg.request_id!r} arrived past the deadline"
        return None

    def _record_layer(self, conn: PeerConn, session: Session, msg: wire.Layer) -> None:
        """Caller holds ``session.lock``."""
        session.layers.add(msg.layer)
        session.bytes += msg.nbytes
        if len(session.layers) == self.layout.num_layers:
            self._set_final(session, "done", None)
            conn.send(wire.Done(request_id=session.request_id, ok=True, bytes=session.bytes))

    def _on_disconnect(self, conn: PeerConn) -> None:
        conn.alive = False
        conn.channel.close()
        if conn.lander is not None:  # layers already received still land
            conn.landing.put(None)
            conn.lander.join(timeout=self.config.connect_timeout_s)
        with self._lock:
            self._conns.discard(conn)
            sessions = [s for s in self._sessions.values() if s.conn is conn]
        for session in sessions:
            with session.lock:
                if session.state == "open":
                    self._set_final(
                        session,
                        "failed",
                        f"prefill peer {conn.channel.peer} went away after "
                        f"{len(session.layers)}/{self.layout.num_layers} layers",
                    )
        torchdist.shutdown(conn.group, conn.backend)
        conn.group = None
        conn.store = None
