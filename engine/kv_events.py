"""KV events: the hashes of the full blocks a block pool caches and evicts, for routers.

The block pool reports each full block it registers in its prefix cache (``stored``) and
each one it evicts (``removed``); ``drain`` hands what accumulated since the last call to
the serving layer, which publishes it so that routers can index which replica holds which
prefix (vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``). A block's hash
chains its parent's (``block_pool.hash_block_tokens``), so a prompt's prefix is a path of
hashes any router can compute from the token ids alone.

A model whose window layers keep a pool of their own (``window_kv``) has a second log for
that pool: its events ride in the same ``KVEvents`` as ``window_stored`` /
``window_removed`` (vLLM tags its events with the KV cache group the same way), since a
prefix hit is usable only where the window pool still holds the hit's window.

Between two drains a hash's events cancel: a block stored and then evicted is reported as
removed only, one evicted and stored again as stored only, so a reader that applies
``stored`` and then ``removed`` ends where the pool ended.

If nobody drains for long, the log stops keeping events past ``max_pending`` and says so
(``KVEvents.lost``): the publisher then sends a snapshot of the whole cache instead.
Pure Python, thread-safe (the engine thread writes, the serving layer drains).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class KVEvents:
    """Events since the previous drain, in order of kind: ``cleared`` (the whole cache was
    dropped, before ``stored``), then ``stored`` and ``removed`` hashes, each in the order
    they happened; a hash is in at most one of the two (the last thing that happened to it).
    ``window_stored`` / ``window_removed``: the same for the window pool, where the engine
    keeps one. ``lost``: events were dropped (a log overflowed); the cache's contents are
    unknown to a reader until it gets a snapshot."""

    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    cleared: bool = False
    lost: bool = False
    window_stored: tuple[int, ...] = ()
    window_removed: tuple[int, ...] = ()

    def with_window(self, window: KVEvents) -> KVEvents:
        """These (the full pool's) events with the window pool's ``window`` added."""
        return KVEvents(
            self.stored,
            self.removed,
            self.cleared or window.cleared,
            self.lost or window.lost,
            window.stored,
            window.removed,
        )


class KVEventLog:
    """Collects a block pool's stored/evicted block hashes between drains."""

    def __init__(self, max_pending: int = 65536) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._lock = threading.Lock()
        # Insertion-ordered sets: a hash's later event cancels its earlier one.
        self._stored: dict[int, None] = {}
        self._removed: dict[int, None] = {}
        self._cleared = False
        self._lost = False

    def stored(self, block_hash: int) -> None:
        with self._lock:
            if self._room():
                self._removed.pop(block_hash, None)
                self._stored[block_hash] = None

    def removed(self, block_hash: int) -> None:
        with self._lock:
            if self._room():
                self._stored.pop(block_hash, None)
                self._removed[block_hash] = None

    def cleared(self) -> None:
        """Every cached block was dropped: earlier events no longer matter."""
        with self._lock:
            self._stored, self._removed = {}, {}
            self._cleared, self._lost = True, False

    def drain(self) -> KVEvents:
        with self._lock:
            events = KVEvents(tuple(self._stored), tuple(self._removed), self._cleared, self._lost)
            self._stored, self._removed = {}, {}
            self._cleared = self._lost = False
        return events

    def _room(self) -> bool:
        if self._lost:
            return False
        if len(self._stored) + len(self._removed) >= self.max_pending:
            self._stored, self._removed, self._lost = {}, {}, True
            return False
        return True
