"""Decode-side state: one expected request (``Session``) and one prefill peer's connection
(``PeerConn``). Plain state holders; ``KVReceiver`` owns the logic and the locking rules:
a session's fields change only under ``Session.lock``."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kvtransfer import wire
from pdserve.kvtransfer.staging import BufferPool


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
    """One prefill peer's control connection and, for torch_dist, its pair group."""

    def __init__(self, channel: wire.Channel) -> None:
        self.channel = channel
        self.transport = ""
        self.backend = ""
        self.group: torch.distributed.ProcessGroup | None = None
        self.store: torch.distributed.TCPStore | None = None
        self.alive = True
        # torch_dist: received layers are scattered on their own thread, so the next layer
        # is already being received while the previous one is written into the pool.
        self.staging: BufferPool | None = None
        self.thread: threading.Thread | None = None  # serves the control connection
        self.lander: threading.Thread | None = None
        # (session or None for a refused layer, header, staging buffer, recv work, timeout)
        self.landing: queue.Queue[
            tuple[Session | None, wire.Layer, torch.Tensor, Any, float] | None
        ] = queue.Queue()
        self._acks: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

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
