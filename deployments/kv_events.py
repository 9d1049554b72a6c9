"""KV events on the wire: each replica publishes its prefix cache's stored/evicted block
hashes, batched, inside its routing stats; the routers index them (``prefix_index``).

``KVEventPublisher`` turns the engine's ``KVEvents`` into numbered ``KVEventBatch``es, one per
stats period, and publishes the last few each time (Serve hands a router only the latest
report, so a router that missed one report still finds its batch in the next). A batch is a
snapshot (the whole cache) every ``snapshot_every`` periods and whenever the engine's log
overflowed or its cache was cleared, so a router that fell behind recovers within a bounded
time. Never touches the engine's state beyond its two read-only calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.kv_events import KVEvents


class KVEventBatch(BaseModel):
    """One stats period's KV events of one replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int = Field(ge=0, description="Batch number, consecutive per replica from 0.")
    stored: tuple[int, ...] = Field(default=(), description="Hashes of full blocks cached.")
    removed: tuple[int, ...] = Field(default=(), description="Hashes of blocks evicted.")
    snapshot: bool = Field(
        default=False,
        description="True: ``stored`` is every hash the cache holds (replaces what a reader "
        "knew); ``removed`` is then empty.",
    )


class KVEventPublisher:
    """Numbers a replica's KV events and keeps the last ``window`` batches to publish.

    ``drain`` returns the engine's events since the last call; ``snapshot`` every hash its
    cache holds now."""

    def __init__(
        self,
        drain: Callable[[], KVEvents],
        snapshot: Callable[[], list[int]],
        *,
        window: int = 4,
        snapshot_every: int = 64,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self._drain = drain
        self._snapshot = snapshot
        self._snapshot_every = snapshot_every
        self._recent: deque[KVEventBatch] = deque(maxlen=window)
        self._seq = 0

    def publish(self) -> list[KVEventBatch]:
        """Close this period's batch; the last ``window`` batches, oldest first."""
        events = self._drain()
        seq, self._seq = self._seq, self._seq + 1
        if events.lost or events.cleared or seq % self._snapshot_every == 0:
            batch = KVEventBatch(seq=seq, stored=tuple(self._snapshot()), snapshot=True)
        else:
            batch = KVEventBatch(seq=seq, stored=events.stored, removed=events.removed)
        self._recent.append(batch)
        return list(self._recent)


def publisher_for(engine: object) -> KVEventPublisher | None:
    """A publisher over an ``AsyncLLMEngine``'s KV events; None for an engine without
    them (test doubles), whose replica then publishes none."""
    drain = getattr(engine, "drain_kv_events", None)
    snapshot = getattr(engine, "cached_block_hashes", None)
    if drain is None or snapshot is None:
        return None
    return KVEventPublisher(drain, snapshot)


def publish(publisher: KVEventPublisher | None) -> list[KVEventBatch]:
    """The publisher's batches, or none without a publisher."""
    return publisher.publish() if publisher is not None else []
