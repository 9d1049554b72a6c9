"""Metrics hooks: every finished transfer is reported to an observer.

The serving layer plugs in an observer that exports ``pdserve:kv_transfer_bytes``,
``pdserve:kv_transfer_seconds`` and ``pdserve:kv_transfer_failures``; ``TransferStats`` is a
small in-memory observer for tests and benchmarks. Observers must be cheap and must not
raise (a raising observer is logged and ignored).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Literal, Protocol

from pdserve.kvtransfer.types import TransferResult

Side = Literal["send", "recv"]
log = logging.getLogger(__name__)


class TransferObserver(Protocol):
    def on_transfer(self, side: Side, result: TransferResult) -> None:
        """Called once per transfer per side, when it ends (success or failure)."""


@dataclass(frozen=True)
class TransferTotals:
    transfers: int
    failures: int
    bytes: int
    seconds: float


class TransferStats:
    """Thread-safe totals per side."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[Side, list[float]] = {"send": [0, 0, 0, 0.0], "recv": [0, 0, 0, 0.0]}

    def on_transfer(self, side: Side, result: TransferResult) -> None:
        with self._lock:
            t = self._totals[side]
            t[0] += 1
            t[1] += 0 if result.ok else 1
            t[2] += result.bytes
            t[3] += result.seconds

    def totals(self, side: Side) -> TransferTotals:
        with self._lock:
            n, f, b, s = self._totals[side]
        return TransferTotals(int(n), int(f), int(b), float(s))


def notify(observer: TransferObserver | None, side: Side, result: TransferResult) -> None:
    if observer is None:
        return
    try:
        observer.on_transfer(side, result)
    except Exception:  # noqa: BLE001 - metrics must never break a transfer
        log.exception("KV transfer observer failed")
