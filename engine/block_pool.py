"""Ref-counted pool of fixed-size KV blocks with a hash-chained prefix cache.

Every block is in exactly one of three states:
  used      ref_count > 0 (in some request's block table; may also carry a hash)
  cached    ref_count == 0 and a registered hash: reusable by a prefix hit, evictable (LRU)
  free      ref_count == 0 and no hash
Allocation takes free blocks first and then evicts the least recently freed cached block.
Only FULL blocks are ever cached; a block's hash chains its parent's hash with its tokens,
so a hit on block i implies the whole prefix up to block i matches.

Pure Python; never touches tensors (the KV bytes live in the model runner's kv_cache).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.engine.kv_events import KVEventLog

NO_PARENT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of a full block given the hash of the block before it (chained)."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockPool:
    """Allocates, shares, caches and evicts KV blocks. Allocation returns ids or None."""

    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        events: KVEventLog | None = None,
    ) -> None:
        """``events``, when given, hears every hash cached and evicted (KV events)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        # Cached, unreferenced blocks in LRU order: first = least recently freed = evicted first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self.num_evictions = 0
        self.events = events

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: int) -> int | None:
        """Block id holding the full block with this hash, if cached."""
        return self._hash_to_block.get(block_hash)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def cached_hashes(self) -> list[int]:
        """Every hash the prefix cache holds now (a snapshot for KV-event readers)."""
        return list(self._hash_to_block)

    # ----------------------------------------------------------------- mutation
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks with ref_count 1, or return None (nothing changes)."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            return None
        out: list[int] = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._evict_hash(self.blocks[block_id])
            block = self.blocks[block_id]
            assert block.ref_count == 0, block
            block.ref_count = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each (cached or used) block: a prefix-cache hit."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                if block_id not in self._evictable:
                    raise RuntimeError(f"touch of free, uncached block {block_id}")
                del self._evictable[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order.

        A block reaching zero becomes cached (most recently used end) if it has a hash,
        otherwise free. Callers pass a request's blocks tail first, so a prompt's last
        blocks, the least likely to be shared, are evicted before its first ones.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a used, full block under ``block_hash``.

        Returns False (and leaves the block uncached) when caching is off or another block
        already holds this hash: two requests computed the same prefix at the same time.
        """
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"cache_block on unreferenced block {block_id}")
        if not self.enable_prefix_caching or block.block_hash is not None:
            return False
        if block_hash in self._hash_to_block:
            return False
        block.block_hash = block_hash
        self._hash_to_block[block_hash] = block_id
        if self.events is not None:
            self.events.stored(block_hash)
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; referenced blocks stay allocated."""
        for block_id in list(self._evictable):
            self._evict_hash(self.blocks[block_id])
            self._free.append(block_id)
        self._evictable.clear()
        for block in self.blocks:
            if block.block_hash is not None:
                self._evict_hash(block)
        if self.events is not None:
            self.events.cleared()

    def _evict_hash(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._hash_to_block[block.block_hash]
        if self.events is not None:
            self.events.removed(block.block_hash)
        block.block_hash = None
        self.num_evictions += 1

    # ----------------------------------------------------------------- checks
    def check_integrity(self) -> None:
        """Raise AssertionError if free + used + cached != total or the indexes disagree."""
        free = set(self._free)
        evictable = set(self._evictable)
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        if len(free) != len(self._free):
            raise AssertionError("a block is listed twice in the free queue")
        if free & evictable or free & used or evictable & used:
            raise AssertionError("a block is in two of free/cached/used")
        total = len(free) + len(evictable) + len(used)
        if total != self.num_blocks:
            raise AssertionError(
                f"free {len(free)} + cached {len(evictable)} + used {len(used)} "
                f"!= total {self.num_blocks}"
            )
        for block in self.blocks:
            if block.ref_count < 0:
                raise AssertionError(f"block {block.block_id} has ref_count {block.ref_count}")
            if block.block_id in free and block.block_hash is not None:
                raise AssertionError(f"free block {block.block_id} still carries a hash")
            if block.block_id in evictable and block.block_hash is None:
                raise AssertionError(f"cached block {block.block_id} has no hash")
            if (
                block.block_hash is not None
                and self._hash_to_block.get(block.block_hash) != block.block_id
            ):
                raise AssertionError(f"hash index disagrees for block {block.block_id}")
        if len(self._hash_to_block) != sum(b.block_hash is not None for b in self.blocks):
            raise AssertionError("hash index holds entries for blocks without a hash")
