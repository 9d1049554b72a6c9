"""KV events on the wire: each replica publishes its prefix cache's stored/evicted block
hashes, batched, inside its routing stats; the routers index them (``prefix_index``).

``KVEventPublisher`` turns the engine's ``KVEvents`` into numbered ``KVEventBatch``es, one per
stats period, and publishes the last few each time (Serve hands a router only the latest
report, so a router that missed one report still finds its batch in the next). A batch is a
snapshot (the whole cache) every ``snapshot_every`` periods and whenever the engine's log
overflowed or its cache was cleared, so a router that fell behind recovers within a bounded
time. Never touches the engine's state beyond its read-only calls.

An engine whose window layers keep a pool of their own publishes that pool's hashes too
(``window_stored`` / ``window_removed``) and ``window_blocks``: a prefix hit of n blocks
is usable there only while the window pool holds blocks [n - window_blocks, n), so a
router that knew only the full pool's hashes would credit the replica with hits it
recomputes.
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
        "knew), ``window_stored`` every hash the window pool holds; the removed lists are "
        "then empty.",
    )
    window_stored: tuple[int, ...] = Field(
        default=(), description="Hashes of full blocks the window layers' pool cached."
    )
    window_removed: tuple[int, ...] = Field(
        default=(), description="Hashes of blocks the window layers' pool evicted."
    )
    window_blocks: int = Field(
        default=0,
        ge=0,
        description="How many of a prefix hit's last blocks the window pool must hold for "
        "the replica to use the hit (0: no window pool, every full-pool hit is usable).",
    )


class KVEventPublisher:
    """Numbers a replica's KV events and keeps the last ``window`` batches to publish.

    ``drain`` returns the engine's events since the last call; ``snapshot`` every hash its
    cache holds now, ``window_snapshot`` every hash its window pool holds (with
    ``window_blocks``, the engine's ``window_hit_blocks``)."""

    def __init__(
        self,
        drain: Callable[[], KVEvents],
        snapshot: Callable[[], list[int]],
        *,
        window: int = 4,
        snapshot_every: int = 64,
        window_snapshot: Callable[[], list[int]] | None = None,
        window_blocks: int = 0,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        if window_blocks < 0:
            raise ValueError(f"window_blocks must be >= 0, got {window_blocks}")
        self._drain = drain
        self._snapshot = snapshot
        self._window_snapshot = window_snapshot
        self._window_blocks = window_blocks
        self._snapshot_every = snapshot_every
        self._recent: deque[KVEventBatch] = deque(maxlen=window)
        self._seq = 0

    def publish(self) -> list[KVEventBatch]:
        """Close this period's batch; the last ``window`` batches, oldest first."""
        events = self._drain()
        seq, self._seq = self._seq, self._seq + 1
        if events.lost or events.cleared or seq % self._snapshot_every == 0:
            window = self._window_snapshot() if self._window_snapshot is not None else []
            batch = KVEventBatch(
                seq=seq,
                stored=tuple(self._snapshot()),
                snapshot=True,
                window_stored=tuple(window),
                window_blocks=self._window_blocks,
            )
        else:
            batch = KVEventBatch(
                seq=seq,
                stored=events.stored,
                removed=events.removed,
                window_stored=events.window_stored,
                window_removed=events.window_removed,
                window_blocks=self._window_blocks,
            )
        self._recent.append(batch)
        return list(self._recent)


def publisher_for(engine: object) -> KVEventPublisher | None:
    """A publisher over an ``AsyncLLMEngine``'s KV events; None for an engine without
    them (test doubles), whose replica then publishes none."""
    drain = getattr(engine, "drain_kv_events", None)
    snapshot = getattr(engine, "cached_block_hashes", None)
    if drain is None or snapshot is None:
        return None
    window_blocks = getattr(engine, "window_hit_blocks", 0)
    window_snapshot = getattr(engine, "cached_window_block_hashes", None)
    if not window_blocks or window_snapshot is None:
        return KVEventPublisher(drain, snapshot)
    return KVEventPublisher(
        drain, snapshot, window_snapshot=window_snapshot, window_blocks=window_blocks
    )


def publish(publisher: KVEventPublisher | None) -> list[KVEventBatch]:
    """The publisher's batches, or none without a publisher."""
    return publisher.publish() if publisher is not None else []
