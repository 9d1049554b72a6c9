"""The paged-KV tile read that the Triton attention kernels share (``decode.py``,
``prefill.py``): ``BLOCK_N`` consecutive context positions of one KV head, found through a
sequence's block table. Inlined into each kernel by Triton; never launched on its own."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_cache_ptr,  # [N, B, Hkv, D]
    v_cache_ptr,  # [N, B, Hkv, D]
    table,  # this sequence's block table row
    n,  # [BLOCK_N] context positions
    valid,  # [BLOCK_N] which of them to read (the rest load as 0)
    kv_head,
    d,  # [BLOCK_D]
    d_mask,  # [BLOCK_D]
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,  # paged block size
):
    """K and V of positions ``n``, each ``[BLOCK_N, BLOCK_D]`` in the cache's dtype."""
    block = tl.load(table + n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offset = (n % BLOCK_SIZE).to(tl.int64)
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(
        k_cache_ptr
        + block[:, None] * stride_kn
        + offset[:, None] * stride_kb
        + kv_head * stride_kh
        + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr
        + block[:, None] * stride_vn
        + offset[:, None] * stride_vb
        + kv_head * stride_vh
        + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    return k, v
