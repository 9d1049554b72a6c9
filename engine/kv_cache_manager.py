"""Block tables of requests on top of the BlockPool: allocation, prefix hits, caching, freeing.

The scheduler asks ``allocate_slots`` for room before it schedules tokens; ``None`` means
"no room" and nothing was changed, so the scheduler can preempt and retry. Never touches
tensors; the block ids index the model runner's kv_cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pdserve.engine.block_pool import NO_PARENT_HASH, BlockPool, hash_block_tokens
from pdserve.engine.request import Request

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pdserve.engine.window_kv import WindowKV


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns every request's ``block_ids`` and the pool they come from, and with ``window``
    (a model whose window layers have a pool of their own) its ``window_block_ids``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: WindowKV | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if window is not None and window.block_size != block_size:
            raise ValueError(f"window pool block_size {window.block_size} != {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.window = window
        # Prefix-cache effectiveness, in tokens (queries count prompt tokens looked up).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks that hold a prefix of the request's tokens, and how many tokens.

        At least one token is always left to compute, since its logits are needed to sample.
        Takes no reference yet: pass the blocks to ``allocate_slots``.
        """
        if not self.enable_prefix_caching or request.block_ids:
            return [], 0
        self._extend_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.window is not None:  # only as far as the window pool holds its window too
            del hits[self.window.usable_hit(request.block_hashes, len(hits)) :]
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (not the retries of a request that had to wait)."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_block_ids: Sequence[int] = (),
    ) -> list[int] | None:
        """Make the block table cover computed + prefix-hit + ``num_new_tokens`` tokens.

        Returns the newly allocated block ids (possibly empty), or None when the pool cannot
        supply them; on None neither the request nor the pool changed, except that window
        blocks already out of the request's window may have been released.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if computed_block_ids and request.block_ids:
            raise ValueError("prefix hits can only be added to an empty block table")
        start = request.num_computed_tokens + len(computed_block_ids) * self.block_size
        num_tokens = start + num_new_tokens
        num_have = len(request.block_ids) + len(computed_block_ids)
        num_needed = max(0, self.num_blocks_for(num_tokens) - num_have)
        # Hits on unreferenced cached blocks take them out of the allocatable set.
        num_revived = sum(1 for b in computed_block_ids if self.pool.is_evictable(b))
        if num_needed + num_revived > self.pool.num_free_blocks:
            return None
        window_hits = self._window_room(request, start, num_tokens, len(computed_block_ids))
        if window_hits is None:
            return None
        if computed_block_ids:
            self.pool.touch(computed_block_ids)
            request.block_ids.extend(computed_block_ids)
            request.num_hashed_blocks = len(computed_block_ids)
        new_blocks = self.pool.allocate(num_needed)
        assert new_blocks is not None  # guarded by the free-count check above
        request.block_ids.extend(new_blocks)
        if self.window is not None:
            self.window.extend(request, window_hits, len(request.block_ids))
        return new_blocks

    def _window_room(
        self, request: Request, start: int, num_tokens: int, num_hit_blocks: int
    ) -> list[int] | None:
        """The window table a prefix hit brings ([] without one), or None when the window
        pool cannot supply the blocks up to ``num_tokens``. Releases the blocks already
        out of the window of ``start`` first (they are never needed again)."""
        window = self.window
        if window is None:
            return []
        hits: list[int] = []
        if num_hit_blocks:
            found = window.lookup(request.block_hashes, num_hit_blocks)
            if found is None:
                raise RuntimeError(
                    f"request {request.request_id}: its prefix hit has no window blocks "
                    "(get_computed_blocks shortens it; the pool changed in between)"
                )
            hits = found
        else:
            window.release(request, start)
        have = len(request.window_block_ids) + len(hits)
        needed = max(0, self.num_blocks_for(num_tokens) - have)
        revived = sum(1 for b in set(hits) if window.pool.is_evictable(b))
        if needed + revived > window.pool.num_free_blocks:
            return None
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_hashed_blocks:
            return
        self._extend_block_hashes(request)
        for i in range(request.num_hashed_blocks, num_full):
            self.pool.cache_block(request.block_ids[i], request.block_hashes[i])
        if self.window is not None:
            self.window.cache_blocks(request, request.num_hashed_blocks, num_full)
        request.num_hashed_blocks = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so its prefix stays cached longest)."""
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_hashed_blocks = 0
        if self.window is not None:
            self.window.free(request)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        if self.window is not None:
            self.window.pool.reset_prefix_cache()

    def check_integrity(self, live_requests: Iterable[Request]) -> None:
        """Pool counts add up and every ref count equals the block tables that hold it."""
        self.pool.check_integrity()
        live = list(live_requests)
        refs: Counter[int] = Counter()
        for request in live:
            refs.update(request.block_ids)
        for block in self.pool.blocks:
            if block.ref_count != refs.get(block.block_id, 0):
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count} but held by "
                    f"{refs.get(block.block_id, 0)} block tables"
                )
        if self.window is not None:
            self.window.check_integrity(live)

    def _extend_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        num_full = request.num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else NO_PARENT_HASH
            hashes.append(hash_block_tokens(parent, request.tokens_slice(i * bs, (i + 1) * bs)))
