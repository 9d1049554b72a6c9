"""The KV blocks of sliding-window layers, held only while they are inside the window.

A model whose layers mix full attention and a sliding window W (gpt-oss, Gemma 2/3) keeps
the window layers' KV in a pool of their own (``WindowKV``), next to the full layers'
pool. Each request has a second block table, ``Request.window_block_ids``, with one entry
per block of the sequence like ``block_ids``; once every position of a block is older than
the window of the next token computed, the block goes back to the pool and its entry
becomes ``NULL_BLOCK``, a block that is allocated once, never written and never read (the
attention kernels skip or mask every key outside the window). A sequence therefore holds
about ``cdiv(W + chunk, B) + 1`` window blocks, whatever its length.

Prefix caching: window blocks are registered under the same hash chain as the full pool's
blocks. A prefix hit of P tokens needs the full pool's blocks for [0, P) and the window
pool's for the blocks holding [P - W + 1, P); ``usable_hit`` shortens P until both hold.

Pure Python; never touches tensors (the model runner owns the window pool tensor).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import cdiv
from pdserve.engine.kv_layout import KVLayerSpec
from pdserve.engine.request import Request

NULL_BLOCK = 0


@dataclass(frozen=True)
class WindowLayout:
    """Which layers keep their KV in the window pool, the window it holds, its blocks."""

    window: int  # the largest window of those layers: smaller ones keep as much
    layers: tuple[int, ...]  # decoder layer indexes, ascending
    num_blocks: int  # window pool blocks, the null block included

    def __post_init__(self) -> None:
        if self.window < 1 or not self.layers or self.num_blocks < 2:
            raise ValueError(f"WindowLayout: invalid {self}")

    def full_layers(self, num_layers: int) -> tuple[int, ...]:
        """The decoder layers of the full pool (the others), ascending."""
        members = set(self.layers)
        return tuple(i for i in range(num_layers) if i not in members)


def plan_window_layout(
    kv_layers: Sequence[KVLayerSpec],
    block_size: int,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> WindowLayout | None:
    """The window pool of a model that mixes full-attention and window layers; None when
    every layer attends everything or every layer has a window (one pool serves them)."""
    windowed = [i for i, spec in enumerate(kv_layers) if spec.sliding_window is not None]
    if not windowed or len(windowed) == len(kv_layers):
        return None
    window = max(kv_layers[i].sliding_window or 0 for i in windowed)
    num_blocks = window_pool_blocks(
        window,
        block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    return WindowLayout(window, tuple(windowed), num_blocks)


def window_pool_blocks(
    window: int,
    block_size: int,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> int:
    """Blocks of a window pool in which ``max_num_seqs`` sequences always fit (null block
    included): each holds its window's blocks plus the one partly out of it, and one step's
    new tokens add at most ``cdiv(budget, B)`` blocks plus one partial block per sequence.
    Never more than full-length sequences would take without a window."""
    per_seq = cdiv(window, block_size) + 1
    bounded = max_num_seqs * (per_seq + 1) + cdiv(max_num_batched_tokens, block_size)
    unbounded = max_num_seqs * cdiv(max_model_len, block_size)
    return min(bounded, unbounded) + 1


class WindowKV:
    """The window layers' pool and the per-request window block tables."""

    def __init__(
        self, window: int, block_size: int, num_blocks: int, enable_prefix_caching: bool
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if num_blocks < 2:
            raise ValueError(
                f"a window pool needs >= 2 blocks (one is the null block), got {num_blocks}"
            )
        self.window = window
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        null = self.pool.allocate(1)
        assert null == [NULL_BLOCK], null  # held for the pool's life: never handed out

    @property
    def hit_blocks(self) -> int:
        """How many of a prefix hit's last blocks ``lookup`` needs: a hit of n blocks uses
        window blocks [n - hit_blocks, n) (``first_needed_block(n * B)``), none before."""
        return cdiv(self.window - 1, self.block_size)

    def first_needed_block(self, start: int) -> int:
        """Index of the oldest block a token at position ``start`` (or later) attends."""
        return max(0, (start - self.window + 1) // self.block_size)

    def release(self, request: Request, start: int) -> None:
        """Free the request's window blocks wholly older than the window of position
        ``start`` (the next token to compute); their entries become NULL_BLOCK."""
        table = request.window_block_ids
        freed: list[int] = []
        j = min(self.first_needed_block(start), len(table)) - 1
        while j >= 0 and table[j] != NULL_BLOCK:  # freed entries form a prefix
            freed.append(table[j])
            table[j] = NULL_BLOCK
            j -= 1
        self.pool.free(freed)  # newest first: the oldest stay cached longest

    def lookup(self, block_hashes: Sequence[int], num_blocks: int) -> list[int] | None:
        """The window table of a prefix hit of ``num_blocks`` full blocks (NULL_BLOCK
        where the window does not reach), or None when a block it needs is not cached."""
        lo = self.first_needed_block(num_blocks * self.block_size)
        table = [NULL_BLOCK] * lo
        for block_hash in block_hashes[lo:num_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                return None
            table.append(block_id)
        return table

    def usable_hit(self, block_hashes: Sequence[int], num_blocks: int) -> int:
        """The longest prefix hit, at most ``num_blocks`` blocks, whose window is cached."""
        while num_blocks > 0 and self.lookup(block_hashes, num_blocks) is None:
            num_blocks -= 1
        return num_blocks

    def extend(self, request: Request, hits: Sequence[int], length: int, skip: int = 0) -> None:
        """Append a prefix hit's window table (``lookup``; one more reference on each of
        its blocks), ``NULL_BLOCK`` entries up to ``skip`` and new blocks up to ``length``
        entries; the caller checked the room."""
        self.pool.touch(b for b in hits if b != NULL_BLOCK)
        request.window_block_ids.extend(hits)
        pad = min(skip, length) - len(request.window_block_ids)
        request.window_block_ids.extend([NULL_BLOCK] * max(0, pad))
        new = self.pool.allocate(length - len(request.window_block_ids))
        assert new is not None  # the caller checked num_free_blocks
        request.window_block_ids.extend(new)

    def cache_blocks(self, request: Request, first: int, stop: int) -> None:
        """Register the request's window blocks ``[first, stop)`` still held, by their
        hashes (the same chain as the full pool's)."""
        table = request.window_block_ids
        for i in range(first, min(stop, len(table))):
            if table[i] != NULL_BLOCK:
                self.pool.cache_block(table[i], request.block_hashes[i])

    def free(self, request: Request) -> None:
        """Release every window block the request holds (newest first)."""
        self.pool.free(b for b in reversed(request.window_block_ids) if b != NULL_BLOCK)
        request.window_block_ids = []

    def num_held(self, request: Request) -> int:
        return sum(1 for b in request.window_block_ids if b != NULL_BLOCK)

    def check_integrity(self, live_requests: Iterable[Request]) -> None:
        """Pool counts add up and every ref count equals the window tables that hold it
        (the null block: one, the pool's own)."""
        self.pool.check_integrity()
        refs: Counter[int] = Counter({NULL_BLOCK: 1})
        for request in live_requests:
            refs.update(b for b in request.window_block_ids if b != NULL_BLOCK)
        for block in self.pool.blocks:
            if block.ref_count != refs.get(block.block_id, 0):
                raise AssertionError(
                    f"window block {block.block_id}: ref_count {block.ref_count} but held by "
                    f"{refs.get(block.block_id, 0)} window tables"
                )
