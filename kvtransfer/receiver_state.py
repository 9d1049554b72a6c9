"""Decode-side state: one expected request (``Session``), one prefill peer's share of it
(``HeadShare``) and one prefill peer's connection (``PeerConn``). Plain state holders;
``KVReceiver`` owns the logic and the locking rules: a session's fields change only under
``Session.lock``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kvtransfer import wire
from pdserve.kvtransfer.types import KVLayout


@dataclass
class HeadShare:
    """One prefill peer's share of a session: the global heads it opened (the ranks of a
    tensor-parallel prefill replica each open a disjoint share) and, per layer, which of
    the request's blocks landed (a prompt prefilled in chunks arrives chunk by chunk)."""

    conn: PeerConn
    heads: range
    block_bytes: int  # one block of one layer, K and V, of these heads
    # layer -> indices (into the session's blocks) whose headers were accepted (torch_dist:
    # maybe still in flight) / that landed.
    announced: dict[int, set[int]] = field(default_factory=dict)
    landed: dict[int, set[int]] = field(default_factory=dict)
    num_landed: int = 0  # (layer, block) pairs landed
    messages: int = 0  # layer messages landed
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
    messages: int = 0  # layer messages landed, over every share
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def share_complete(self, share: HeadShare) -> bool:
        """Every block of every layer of the share's heads landed."""
        return share.num_landed == self.num_layers * len(self.block_ids)

    def complete(self) -> bool:
        """Every layer of every head landed (shares are disjoint and inside ``heads``)."""
        landed = sum(len(s.heads) for s in self.shares.values() if self.share_complete(s))
        return landed == len(self.heads)

    def progress(self) -> str:
        """What landed so far, per share, what is missing, and the heads nobody opened (for
        errors)."""
        shares = sorted(self.shares.values(), key=lambda s: s.heads.start)
        parts = [self.share_progress(s) for s in shares]
        unopened = [h for h in self.heads if not any(h in s.heads for s in self.shares.values())]
        if unopened:
            parts.append(f"heads {unopened} not opened")
        return "; ".join(parts) or "nothing opened"

    def share_progress(self, share: HeadShare) -> str:
        """'heads [a, b): x/y (layer, block) pairs landed; missing: blocks [i, j) of layers
        [k, l), ...' for one share."""
        n, total = len(self.block_ids), self.num_layers * len(self.block_ids)
        head = f"heads [{share.heads.start}, {share.heads.stop}): {share.num_landed}/{total}"
        head += f" (layer, block) pairs landed ({n} blocks x {self.num_layers} layers)"
        if share.num_landed == total:
            return head
        # Layers with the same missing blocks are grouped: chunked sends leave a suffix.
        groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for layer in range(self.num_layers):
            got = share.landed.get(layer, set())
            missing = _runs(b for b in range(n) if b not in got)
            if missing:
                groups.setdefault(tuple(missing), []).append(layer)
        shown = [
            f"blocks {_describe(blocks)} of layers {_describe(_runs(layers))}"
            for blocks, layers in list(groups.items())[:4]
        ]
        more = f" and {len(groups) - 4} more groups" if len(groups) > 4 else ""
        return f"{head}; missing: {'; '.join(shown)}{more}"


def _runs(values: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted ints -> maximal [start, stop) runs."""
    out: list[tuple[int, int]] = []
    for v in values:
        if out and out[-1][1] == v:
            out[-1] = (out[-1][0], v + 1)
        else:
            out.append((v, v + 1))
    return out


def _describe(runs: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> str:
    text = ", ".join(f"[{a}, {b})" for a, b in runs[:6])
    return text + (f" and {len(runs) - 6} more runs" if len(runs) > 6 else "")


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
