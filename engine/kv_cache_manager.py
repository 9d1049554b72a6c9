"""Block tables of requests on top of the BlockPool: allocation, prefix hits, caching, freeing.

The scheduler asks ``allocate_slots`` for room before it schedules tokens; ``None`` means
"no room" and nothing was changed, so the scheduler can preempt and retry. Never touches
tensors; the block ids index the model runner's kv_cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from pdserve.engine.block_pool import NO_PARENT_HASH, BlockPool, hash_block_tokens
from pdserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns every request's ``block_ids`` and the pool they come from."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
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
        supply them; on None neither the request nor the pool changed.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if computed_block_ids and request.block_ids:
            raise ValueError("prefix hits can only be added to an empty block table")
        num_tokens = (
            request.num_computed_tokens + len(computed_block_ids) * self.block_size + num_new_tokens
        )
        num_have = len(request.block_ids) + len(computed_block_ids)
        num_needed = max(0, self.num_blocks_for(num_tokens) - num_have)
        # Hits on unreferenced cached blocks take them out of the allocatable set.
        num_revived = sum(1 for b in computed_block_ids if self.pool.is_evictable(b))
        if num_needed + num_revived > self.pool.num_free_blocks:
            return None
        if computed_block_ids:
            self.pool.touch(computed_block_ids)
            request.block_ids.extend(computed_block_ids)
            request.num_hashed_blocks = len(computed_block_ids)
        new_blocks = self.pool.allocate(num_needed)
        assert new_blocks is not None  # guarded by the free-count check above
        request.block_ids.extend(new_blocks)
        return new_blocks

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
        request.num_hashed_blocks = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so its prefix stays cached longest)."""
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def check_integrity(self, live_requests: Iterable[Request]) -> None:
        """Pool counts add up and every ref count equals the block tables that hold it."""
        self.pool.check_integrity()
        refs: Counter[int] = Counter()
        for request in live_requests:
            refs.update(request.block_ids)
        for block in self.pool.blocks:
            if block.ref_count != refs.get(block.block_id, 0):
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count} but held by "
                    f"{refs.get(block.block_id, 0)} block tables"
                )

    def _extend_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        num_full = request.num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else NO_PARENT_HASH
            hashes.append(hash_block_tokens(parent, request.tokens_slice(i * bs, (i + 1) * bs)))
