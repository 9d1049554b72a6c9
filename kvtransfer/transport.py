"""The interface every KV transport implements: shared memory, CUDA IPC, torch.distributed.

The control channel (``wire``: hello, open with the request's token, layer headers, done,
cancel) and its checks are the same for every transport; a transport only moves a layer's
bytes from the prefill pool into the decode pool's reserved blocks. ``SendTransport`` is the
prefill side of one connection; ``ReceiveTransport`` is the decode side of one transport,
shared by the connections that use it (their per-connection state hangs off ``PeerConn``).
Which transport a pair uses is decided in one place, ``pdserve.kvtransfer.node``; this module
implements none and never touches a socket.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pdserve.kvtransfer.types import TransportName

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from pdserve.kvtransfer import wire
    from pdserve.kvtransfer.config import KVTransferConfig
    from pdserve.kvtransfer.receiver_state import PeerConn, Session
    from pdserve.kvtransfer.send_handle import SendHandle
    from pdserve.kvtransfer.types import KVLayout


class TransportUnavailableError(Exception):
    """The receiver cannot serve the transport a peer asked for (the message says why)."""


class SendTransport(ABC):
    """Prefill side of one connection to a decode peer.

    The peer's worker thread calls ``open`` once, then ``write_layer`` per layer and
    ``drain`` whenever it runs out of work; ``close`` may come from any thread, at any time,
    more than once.
    """

    name: ClassVar[TransportName]

    @abstractmethod
    def open(self, reply: wire.HelloOk, peer_host: str) -> None:
        """Reach the peer's pool: map it (shm, CUDA IPC) or build the pair's group
        (torch.distributed; blocks until the peer built its side). Raises on failure."""

    @abstractmethod
    def write_layer(
        self,
        handle: SendHandle,
        layer: int,
        src: torch.Tensor,  # [2, N, B, H, D]: one layer of the prefill pool
        ready: Any | None,
        channel: wire.Channel,
        span: range | None = None,
    ) -> bool:
        """Move layer ``layer`` of the handle's blocks ``span`` (indices into the request's
        blocks; default every block known so far) into the peer's reserved blocks and
        announce it on ``channel`` with one ``wire.Layer`` header.

        ``ready`` is a CUDA event recorded once the layer was computed (None on CPU).
        Returns False when the request was cancelled meanwhile (nothing was written). May
        return while the bytes are still on their way; ``drain`` waits for them."""

    def drain(self) -> None:
        """Wait for writes still in flight; raises if the pair broke (the caller then
        drops the peer). Transports that write synchronously have nothing to wait for."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release the mapped pool or the pair's group (idempotent; the peer may be gone)."""


class LandingSite(Protocol):
    """What a ``ReceiveTransport`` needs of the receiver it serves (``KVReceiver``)."""

    kv_cache: torch.Tensor  # [L, P, N, B, H, D]
    layout: KVLayout
    config: KVTransferConfig

    def record_layer(self, conn: PeerConn, session: Session, msg: wire.Layer) -> None:
        """Count a landed layer (completes the session after the last). Caller holds
        ``session.lock``."""

    def fail_session(self, session: Session, error: str) -> None:
        """End the session as failed. Caller holds ``session.lock``."""

    def bind_device(self) -> None:
        """Set up an I/O thread (single-threaded copies, the pool's CUDA device)."""


class ReceiveTransport(ABC):
    """Decode side of one transport, shared by every connection that uses it."""

    name: ClassVar[TransportName]

    @abstractmethod
    def export(self, conn: PeerConn, hello: wire.Hello) -> dict[str, Any]:
        """The ``HelloOk`` fields telling the peer how to reach the pool (segment name, IPC
        handle, store port). Raises ``TransportUnavailableError``."""

    def accept(self, conn: PeerConn) -> None:
        """After the ``HelloOk`` went out: per-connection setup (torch_dist: the pair's
        group and its landing thread; blocks until the peer built its side)."""
        return None

    @abstractmethod
    def land(self, conn: PeerConn, session: Session | None, msg: wire.Layer) -> None:
        """The peer announced layer ``msg.layer`` of ``session``; get it into the session's
        blocks. ``session`` is None when the header was refused: a transport whose bytes
        follow the header still consumes them. Raising drops the connection."""

    @abstractmethod
    def fence(self, conn: PeerConn, request_id: str) -> None:
        """Tell the peer to stop writing the request; return once it no longer can."""

    def disconnect(self, conn: PeerConn) -> None:
        """The connection ended: land what already arrived, release its state."""
        return None
