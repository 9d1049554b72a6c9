"""The control channel: typed messages framed over a TCP socket.

Every message is a frozen pydantic model with a ``kind`` tag, sent as a 4-byte big-endian
length followed by its JSON. The channel carries only headers (who, which request, which
layer, how many bytes); KV bytes travel over the transport (shared memory, CUDA IPC or a
torch.distributed group). This module never touches tensors.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from pdserve.kvtransfer.types import KVLayout

_LEN = struct.Struct("!I")
MAX_MESSAGE_BYTES = 1 << 20


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Hello(_Msg):
    """Sender -> receiver, first message on a connection: who I am and my pool layout."""

    kind: Literal["hello"] = "hello"
    layout: KVLayout
    node_id: str
    transport: str = Field(description="Transport the sender will use on this connection.")
    device: str = Field(description="'cpu' or 'cuda' (the sender's pool).")


class HelloOk(_Msg):
    """Receiver -> sender: layouts match; how to reach my pool."""

    kind: Literal["hello_ok"] = "hello_ok"
    transport: str
    shm_name: str | None = None
    ipc_handle: str | None = None  # hex of cudaIpcMemHandle_t
    pool_shape: tuple[int, ...] = ()
    pool_dtype: str = ""
    store_port: int | None = None
    backend: str | None = None


class Open(_Msg):
    """Sender -> receiver: start writing heads ``[head_start, head_start + num_heads)``
    (global indices) of request ``request_id``; proves it with ``token``. Several senders
    (the ranks of a tensor-parallel prefill replica) may each open a disjoint share of the
    receiver's heads."""

    kind: Literal["open"] = "open"
    request_id: str
    token: str
    num_blocks: int
    head_start: int = Field(ge=0, description="Global index of the first head sent.")
    num_heads: int = Field(gt=0, description="Heads sent, contiguous from head_start.")


class OpenOk(_Msg):
    """Receiver -> sender: granted; ``block_ids`` and ``head_offset`` are the receiver's own
    record (a direct write lands there)."""

    kind: Literal["open_ok"] = "open_ok"
    request_id: str
    block_ids: tuple[int, ...]
    head_offset: int = Field(
        ge=0, description="Where the opened heads start in the receiver's pool (its head dim)."
    )


class Layer(_Msg):
    """Sender -> receiver: one layer of some of a request's blocks was written (shm/IPC) or
    follows (torch_dist with tag ``seq``). A prompt prefilled in chunks is sent chunk by
    chunk: each message carries the blocks ``[block_start, block_start + num_blocks)`` of
    the request (indices into its block list), and every block of every layer must land
    exactly once."""

    kind: Literal["layer"] = "layer"
    request_id: str
    layer: int
    nbytes: int
    head_start: int = Field(ge=0, description="Global index of the layer's first head.")
    num_heads: int = Field(gt=0, description="Heads in the layer, as opened.")
    block_start: int = Field(ge=0, description="Index (in the request's blocks) of the first.")
    num_blocks: int = Field(gt=0, description="Consecutive blocks of the request carried.")
    seq: int = 0


class Abort(_Msg):
    """Sender -> receiver: the prefill side gave the request up (aborted or preempted before
    its last chunk); nothing more will be written for it. The receiver fails the request."""

    kind: Literal["abort"] = "abort"
    request_id: str
    reason: str


class Done(_Msg):
    """Receiver -> sender: the sender's share of the request ended (every layer of its
    heads landed, or failed)."""

    kind: Literal["done"] = "done"
    request_id: str
    ok: bool
    bytes: int = 0
    error: str | None = None


class Cancel(_Msg):
    """Receiver -> sender: stop writing this request; answer with ``CancelAck`` once stopped."""

    kind: Literal["cancel"] = "cancel"
    request_id: str


class CancelAck(_Msg):
    """Sender -> receiver: no further write for this request will happen."""

    kind: Literal["cancel_ack"] = "cancel_ack"
    request_id: str


class Error(_Msg):
    """Either direction: a refusal. ``request_id`` is None for connection-level errors."""

    kind: Literal["error"] = "error"
    code: Literal["layout_mismatch", "refused", "protocol", "timeout", "transport"]
    message: str
    request_id: str | None = None


Message = Annotated[
    Hello | HelloOk | Open | OpenOk | Layer | Abort | Done | Cancel | CancelAck | Error,
    Field(discriminator="kind"),
]
_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


class Channel:
    """One framed, thread-safe-for-send connection. Reads happen on one thread only."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.peer = "{}:{}".format(*sock.getpeername()[:2])
        else:  # a socketpair (tests)
            self.peer = "local"

    def send(self, msg: _Msg) -> None:
        data = msg.model_dump_json().encode()
        with self._send_lock:
            self.sock.sendall(_LEN.pack(len(data)) + data)

    def recv(self) -> Message | None:
        """The next message, or None when the peer closed the connection."""
        head = self._recv_exact(_LEN.size)
        if head is None:
            return None
        (n,) = _LEN.unpack(head)
        if n > MAX_MESSAGE_BYTES:
            raise ConnectionError(f"control message of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
        body = self._recv_exact(n)
        if body is None:
            return None
        return _ADAPTER.validate_json(body)

    def _recv_exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except OSError:
                return None
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def connect(address: str, timeout: float) -> Channel:
    """Open a control connection to ``host:port`` (bounded by ``timeout``)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(None)
    return Channel(sock)


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address: expected 'host:port', got {address!r}")
    return host, int(port)
