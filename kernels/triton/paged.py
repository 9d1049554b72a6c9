"""The paged-KV tile read that the Triton attention kernels share (``decode.py``,
``prefill.py``): ``BLOCK_N`` consecutive context positions of one KV head, found through a
sequence's block table. Inlined into each kernel by Triton; never launched on its own."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_slots(table, n, valid, BLOCK_SIZE: tl.constexpr):
    """(block id, offset in the block) of each context position ``n`` [BLOCK_N], int64, read
    from ``table`` (the sequence's block table row); positions not ``valid`` get block 0."""
    block = tl.load(table + n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offset = (n % BLOCK_SIZE).to(tl.int64)
    return block, offset


@triton.jit
def load_tile(cache_ptr, block, offset, kv_head, d, mask, stride_n, stride_b, stride_h):
    """The ``[BLOCK_N, BLOCK_D]`` slice of a ``[N, B, Hkv, D]`` cache at ``block_slots``'
    positions for head ``kv_head`` and dims ``d``; 0 where ``mask`` is False."""
    return tl.load(
        cache_ptr
        + block[:, None] * stride_n
        + offset[:, None] * stride_b
        + kv_head * stride_h
        + d[None, :],
        mask=mask,
        other=0.0,
    )
