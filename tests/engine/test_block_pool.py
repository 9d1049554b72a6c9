"""BlockPool and KVCacheManager: allocation, ref counts, prefix hits, LRU eviction."""

from __future__ import annotations

import pytest

from pdserve.engine.block_pool import NO_PARENT_HASH, BlockPool, hash_block_tokens
from pdserve.engine.kv_cache_manager import KVCacheManager
from tests.engine.fakes import make_request


def test_allocate_and_free_counts() -> None:
    pool = BlockPool(8)
    a = pool.allocate(5)
    assert a is not None and len(set(a)) == 5
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 5
    assert pool.allocate(4) is None  # not enough: nothing taken
    assert pool.num_free_blocks == 3
    pool.check_integrity()
    pool.free(a)
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1) or []
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def test_shared_block_stays_used_until_last_reference() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1) or []
    h = hash_block_tokens(NO_PARENT_HASH, [1, 2])
    assert pool.cache_block(b, h)
    pool.touch([b])  # a second request hits it
    assert pool.blocks[b].ref_count == 2
    pool.free([b])
    assert pool.num_free_blocks == 3 and pool.lookup(h) == b
    pool.free([b])
    assert pool.num_free_blocks == 4 and pool.num_cached_free_blocks == 1
    assert pool.lookup(h) == b  # still cached, reusable
    pool.check_integrity()


def test_free_uncached_blocks_are_used_before_evicting_cached_ones() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3) or []
    pool.cache_block(blocks[0], 111)
    pool.free(blocks)
    new = pool.allocate(2) or []
    assert blocks[0] not in new
    assert pool.lookup(111) == blocks[0]
    pool.check_integrity()


def test_lru_eviction_order() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3) or []
    for i, b in enumerate(blocks):
        pool.cache_block(b, 1000 + i)
    # Free in the order 2, 0, 1: block 2 is the least recently freed.
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[1]])
    assert pool.allocate(1) == [blocks[2]]
    assert pool.lookup(1002) is None and pool.num_evictions == 1
    # Touching a cached block makes it used, so it is not evicted next.
    pool.touch([blocks[0]])
    assert pool.allocate(1) == [blocks[1]]
    assert pool.lookup(1000) == blocks[0]
    assert pool.allocate(1) is None
    pool.check_integrity()


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2) or []
    assert pool.cache_block(a, 5)
    assert not pool.cache_block(b, 5)
    assert pool.lookup(5) == a
    pool.free([a, b])
    assert pool.num_cached_free_blocks == 1
    pool.check_integrity()


def test_integrity_check_detects_corruption() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    pool.blocks[3].ref_count = 1  # a block that is also in the free queue
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_chained_hash_depends_on_parent() -> None:
    h1 = hash_block_tokens(NO_PARENT_HASH, [1, 2, 3, 4])
    h2 = hash_block_tokens(hash_block_tokens(NO_PARENT_HASH, [9, 9, 9, 9]), [1, 2, 3, 4])
    assert h1 != h2


def test_manager_prefix_hit_shares_full_blocks_only() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(10)))
    assert kv.allocate_slots(a, 10) is not None
    assert len(a.block_ids) == 3
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    assert a.num_hashed_blocks == 2  # the third block holds 2 tokens: not cached

    b = make_request("b", list(range(8)) + [99, 98, 97])
    hits, num_tokens = kv.get_computed_blocks(b)
    assert hits == a.block_ids[:2] and num_tokens == 8
    assert kv.allocate_slots(b, 3, hits) is not None
    assert b.block_ids[:2] == a.block_ids[:2] and len(b.block_ids) == 3
    assert kv.pool.blocks[a.block_ids[0]].ref_count == 2
    kv.check_integrity([a, b])
    kv.free(a)
    kv.free(b)
    kv.check_integrity([])
    assert kv.num_free_blocks == 16


def test_manager_leaves_last_token_to_compute_on_full_hit() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    b = make_request("b", list(range(8)))
    hits, num_tokens = kv.get_computed_blocks(b)
    assert num_tokens == 4 and len(hits) == 1  # the last block is recomputed for logits


def test_manager_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.free(a)  # two cached, evictable blocks + two free
    b = make_request("b", list(range(8)) + list(range(100, 112)))
    hits, _ = kv.get_computed_blocks(b)
    assert len(hits) == 2
    # 20 tokens need 5 blocks; 2 from hits + 3 new > 4 in the pool.
    assert kv.allocate_slots(b, 12, hits) is None
    assert b.block_ids == [] and kv.num_free_blocks == 4
    assert all(blk.ref_count == 0 for blk in kv.pool.blocks)
    kv.check_integrity([])
