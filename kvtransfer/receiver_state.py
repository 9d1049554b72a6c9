"""Decode-side state: one expected request (``Session``) and one prefill peer's connection
(``PeerConn``). Plain state holders; ``KVReceiver`` owns the logic and the locking rules:
a session's fields change only under ``Session.lock``."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kvtransfer import wire


@dataclass
class Session:
    request_id: str
    token: str
    block_ids: tuple[int, ...]
    block_index: torch.Tensor  # [n] int64 on the pool's device
    deadline: float
    layer_bytes: int
    created: float = field(default_factory=time.perf_counter)
    opened: float | None = None
    state: str = "expected"  # expected | open | done | failed | cancelled
    conn: PeerConn | None = None
    layers: set[int] = field(default_factory=set)  # landed
    announced: set[int] = field(default_factory=set)  # headers accepted (torch_dist: in flight)
    bytes: int = 0
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class PeerConn:
    """One prefill peer's control connection and its transport's per-connection state."""

    def __init__(self, channel: wire.Channel) -> None:
        self.channel = channel
        # The transport.ReceiveTransport the handshake agreed on (Any: transport.py types
        # its methods with this class, and the two modules must not import each other).
        self.transport: Any = None
        self.link: Any = None  # the transport's state for this connection (torch_dist: its pair)
        self.alive = True
        self.thread: threading.Thread | None = None  # serves the control connection
        self._acks: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    @property
    def transport_name(self) -> str:
        return self.transport.name if self.transport is not None else ""

    def send(self, msg: wire._Msg) -> bool:
        try:
            self.channel.send(msg)
            return True
        except OSError:
            return False

    def ack_event(self, request_id: str) -> threading.Event:
        with self._lock:
            return self._acks.setdefault(request_id, threading.Event())

    def on_ack(self, request_id: str) -> None:
        self.ack_event(request_id).set()

    def drop_ack(self, request_id: str) -> None:
        with self._lock:
            self._acks.pop(request_id, None)
