"""Decode-side state: one expected request (``Session``), one prefill peer's share of it
(``HeadShare``) and one prefill peer's connection (``PeerConn``). Plain state holders;
``KVReceiver`` owns the logic and the locking rules: a session's fields change only under
``Session.lock``."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kvtransfer import wire
from pdserve.kvtransfer.types import KVLayout


@dataclass
class HeadShare:
    """One prefill peer's share of a session: the global heads it opened (the ranks of a
    tensor-parallel prefill replica each open a disjoint share) and its layers."""

    conn: PeerConn
    heads: range
    layer_bytes: int
    layers: set[int] = field(default_factory=set)  # landed
    announced: set[int] = field(default_factory=set)  # headers accepted (torch_dist: in flight)
    bytes: int = 0


@dataclass
class Session:
    request_id: str
    token: str
    block_ids: tuple[int, ...]
    block_index: torch.Tensor  # [n] int64 on the pool's device
    deadline: float
    num_layers: int
    heads: range  # the global heads of the receiving pool: every one must land
    created: float = field(default_factory=time.perf_counter)
    opened: float | None = None
    state: str = "expected"  # expected | open | done | failed | cancelled
    shares: dict[PeerConn, HeadShare] = field(default_factory=dict)
    bytes: int = 0
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def share_complete(self, share: HeadShare) -> bool:
        return len(share.layers) == self.num_layers

    def complete(self) -> bool:
        """Every layer of every head landed (shares are disjoint and inside ``heads``)."""
        landed = sum(len(s.heads) for s in self.shares.values() if self.share_complete(s))
        return landed == len(self.heads)

    def progress(self) -> str:
        """What landed so far, per share, and the heads nobody opened (for errors)."""
        parts = [
            f"heads [{s.heads.start}, {s.heads.stop}): {len(s.layers)}/{self.num_layers} layers"
            for s in sorted(self.shares.values(), key=lambda s: s.heads.start)
        ]
        unopened = [h for h in self.heads if not any(h in s.heads for s in self.shares.values())]
        if unopened:
            parts.append(f"heads {unopened} not opened")
        return "; ".join(parts) or "nothing opened"


class PeerConn:
    """One prefill peer's control connection and its transport's per-connection state."""

    def __init__(self, channel: wire.Channel) -> None:
        self.channel = channel
        # The transport.ReceiveTransport the handshake agreed on (Any: transport.py types
        # its methods with this class, and the two modules must not import each other).
        self.transport: Any = None
        self.link: Any = None  # the transport's state for this connection (torch_dist: its pair)
        self.layout: KVLayout | None = None  # the peer's pool, from its hello
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
