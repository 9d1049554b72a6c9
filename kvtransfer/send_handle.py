"""The prefill side's handle of one request's send (state shared by the sender, the peer's
worker and reader threads, and the transport that writes the bytes)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.kvtransfer.tp_plan import HeadSlice
from pdserve.kvtransfer.types import KVTarget, KVTransferError, TransferResult


@dataclass
class SendHandle:
    """One request's transfer to one decode pool on the prefill side: the heads ``heads``
    of its blocks.

    ``src_block_ids`` are the request's source blocks known so far, in prompt order: a
    prompt prefilled in chunks gets more as its chunks complete them (``KVSender.extend``;
    only the engine's thread appends, before it enqueues a write of the new ones)."""

    target: KVTarget
    src_block_ids: list[int]
    heads: HeadSlice
    started: float = field(default_factory=time.perf_counter)
    dst_block_ids: list[int] = field(default_factory=list)
    dst_head_start: int = 0  # the receiver's word (OpenOk), for direct writes
    bytes_sent: int = 0
    layers_sent: int = 0  # layer messages announced (one per layer per step that sent)
    abort_requested: bool = False  # KVSender.abort queued its job (queued once)
    result: TransferResult | None = None
    error: KVTransferError | None = None
    opened: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    # Held while bytes are written straight into the peer's pool; a Cancel takes it, so
    # once the peer has our CancelAck no write for this request is in flight or to come.
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    # Held while the handle is settled (result, error, finished set together, once).
    state_lock: threading.Lock = field(default_factory=threading.Lock)
    peer: Any = None  # the sender_peer.DecodePeer carrying it (typed loosely: no import cycle)

    @property
    def request_id(self) -> str:
        return self.target.request_id

    def done(self) -> bool:
        return self.finished.is_set()

    def span_bytes(self, span: range) -> int:
        """Bytes of one layer of the blocks ``span`` (indices into the request's blocks):
        K and V, this send's heads."""
        return len(span) * self.target.layout.block_bytes(self.heads.num_heads)

    def count_layer(self, span: range) -> None:
        """Account a layer message of ``span`` about to be announced (before its header
        goes out: the decode side's confirmation may follow at once)."""
        self.bytes_sent += self.span_bytes(span)
        self.layers_sent += 1

    def src_ids(self, span: range) -> list[int]:
        return self.src_block_ids[span.start : span.stop]

    def dst_ids(self, span: range) -> list[int]:
        return self.dst_block_ids[span.start : span.stop]
