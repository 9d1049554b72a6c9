"""Where a request's transfer results meet: merging the results of its several sends (one
per peer, or one per tensor-parallel rank) and keeping them until the serving layer asks."""

from __future__ import annotations

import collections
import threading
import time

from pdserve.kvtransfer.types import TransferResult

MAX_UNCLAIMED_RESULTS = 4096


def merge_results(request_id: str, results: list[TransferResult]) -> TransferResult:
    """A request's result over its sends: ok only if every one was; bytes summed."""
    errors = [r.error or "failed" for r in results if not r.ok]
    return TransferResult(
        request_id=request_id,
        ok=not errors,
        bytes=sum(r.bytes for r in results),
        seconds=max((r.seconds for r in results), default=0.0),
        error="; ".join(errors) if errors else None,
        transport="+".join(sorted({r.transport for r in results if r.transport})),
        layer_messages=sum(r.layer_messages for r in results),
    )


class ResultMailbox:
    """Results waiting for ``take``; bounded, oldest dropped, in case a caller never asks
    (e.g. a request aborted after its send began)."""

    def __init__(self, limit: int = MAX_UNCLAIMED_RESULTS) -> None:
        self._limit = limit
        self._results: collections.OrderedDict[str, TransferResult] = collections.OrderedDict()
        self._ready = threading.Condition()

    def put(self, request_id: str, result: TransferResult) -> None:
        with self._ready:
            self._results[request_id] = result
            while len(self._results) > self._limit:
                self._results.popitem(last=False)
            self._ready.notify_all()

    def take(self, request_id: str, timeout: float | None = None) -> TransferResult | None:
        """The request's result once it is in (waits up to ``timeout``; None after)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready:
            while request_id not in self._results:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._ready.wait(remaining)
            return self._results.pop(request_id)
