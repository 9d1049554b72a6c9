"""A router's view of which replica holds which prompt prefix.

``PrefixIndex`` applies the KV-event batches replicas publish (``kv_events``): per replica,
the set of block hashes its prefix cache holds. A prompt's prefix is a chain of block hashes
(``prompt_block_hashes``, the engine's own hashing), so the blocks a replica holds of a
prompt are the longest run of the chain it holds from the start.

Events lag a stats period or more, so the index also remembers where this router itself
sent each prompt (``routed``), for ``history_ttl_s``: the approximate mode, which is all a
router has for a replica that has not published events (yet). A match is the larger of the
two. Nothing here is exact and nothing needs to be: a wrong guess costs a cache miss, never
a wrong token (the engines look their caches up again).

A replica whose window layers keep a pool of their own (its batches carry
``window_blocks``) uses a hit of n blocks only while that pool holds blocks
[n - window_blocks, n) too (``WindowKV.usable_hit``), so the match is shortened the same
way, over the window pool's events. The routing history stands in for those as well, for
the last ``window_blocks`` blocks of a prompt sent there (the window its prefill leaves
cached; the window of a shorter prefix was released as the prefill passed it).

Plain Python, so the simulator runs the very same index.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

from pdserve.deployments.kv_events import KVEventBatch
from pdserve.engine.block_pool import NO_PARENT_HASH, hash_block_tokens


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hash chain of the prompt's cacheable full blocks (the last token is always
    computed, so a block that ends with it never counts)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent = NO_PARENT_HASH
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


class _ReplicaBlocks:
    """What the events said one replica holds, and the last batch applied."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.window_hashes: set[int] = set()
        self.window_blocks = 0  # 0: no window pool
        self.seq = -1


class PrefixIndex:
    """Per replica: block hashes from its KV events, and this router's recent routings."""

    def __init__(
        self,
        *,
        history_ttl_s: float = 30.0,
        history_max_entries: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if history_ttl_s < 0:
            raise ValueError(f"history_ttl_s must be >= 0, got {history_ttl_s}")
        if history_max_entries < 1:
            raise ValueError(f"history_max_entries must be >= 1, got {history_max_entries}")
        self.history_ttl_s = history_ttl_s
        self.history_max_entries = history_max_entries
        self._clock = clock
        self._events: dict[Hashable, _ReplicaBlocks] = {}
        # (replica, block hash) -> when this router last sent a prompt holding it there;
        # the window history: the same for the blocks that left their window cached.
        self._history: OrderedDict[tuple[Hashable, int], float] = OrderedDict()
        self._window_history: OrderedDict[tuple[Hashable, int], float] = OrderedDict()

    # ---- input
    def apply(self, replica: Hashable, batches: Iterable[KVEventBatch]) -> None:
        """Apply a replica's published batches (those already applied are skipped; a gap
        keeps what is known until the next snapshot replaces it)."""
        known = self._events.setdefault(replica, _ReplicaBlocks())
        for batch in sorted(batches, key=lambda b: b.seq):
            if batch.seq <= known.seq:
                continue
            if batch.snapshot:
                known.hashes = set(batch.stored)
                known.window_hashes = set(batch.window_stored)
            else:
                known.hashes.update(batch.stored)
                known.hashes.difference_update(batch.removed)
                known.window_hashes.update(batch.window_stored)
                known.window_hashes.difference_update(batch.window_removed)
            known.window_blocks = batch.window_blocks
            known.seq = batch.seq

    def routed(self, replica: Hashable, hashes: Sequence[int]) -> None:
        """This router sent a prompt with these block hashes to ``replica``."""
        now = self._clock()
        self._remember(self._history, replica, hashes, now)
        known = self._events.get(replica)
        if known is not None and known.window_blocks and hashes:
            self._remember(self._window_history, replica, hashes[-known.window_blocks :], now)

    def _remember(
        self,
        history: OrderedDict[tuple[Hashable, int], float],
        replica: Hashable,
        hashes: Sequence[int],
        now: float,
    ) -> None:
        for h in hashes:
            key = (replica, h)
            history[key] = now
            history.move_to_end(key)
        while len(history) > self.history_max_entries:
            history.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """The replica is gone."""
        self._events.pop(replica, None)
        for history in (self._history, self._window_history):
            for key in [k for k in history if k[0] == replica]:
                del history[key]

    # ---- queries
    def matched_blocks(self, replica: Hashable, hashes: Sequence[int]) -> int:
        """Leading blocks of the chain ``hashes`` the replica holds (events or history)."""
        known = self._events.get(replica)
        held = known.hashes if known is not None else frozenset()
        history = self._history
        oldest = self._clock() - self.history_ttl_s
        n = 0
        for h in hashes:
            if h in held:
                n += 1
                continue
            seen = history.get((replica, h))
            if seen is None or seen < oldest:
                break
            n += 1
        if known is None or not known.window_blocks:
            return n
        return self._usable_hit(replica, known, hashes, n, oldest)

    def _usable_hit(
        self, replica: Hashable, known: _ReplicaBlocks, hashes: Sequence[int], n: int, oldest: float
    ) -> int:
        """The longest hit, at most ``n`` blocks, whose last ``window_blocks`` blocks the
        window pool holds (events or window history), as the engine shortens it."""
        held = known.window_hashes
        history = self._window_history

        def has(h: int) -> bool:
            seen = history.get((replica, h))
            return h in held or (seen is not None and seen >= oldest)

        while n > 0 and not all(has(h) for h in hashes[max(0, n - known.window_blocks) : n]):
            n -= 1
        return n

    def has_events(self, replica: Hashable) -> bool:
        return replica in self._events
