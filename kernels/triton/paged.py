"""What the Triton attention kernels share (``decode.py``, ``mla_decode.py``,
``prefill.py``, ``mla_prefill.py``): the paged-KV tile read (``BLOCK_N`` consecutive context
positions of one KV head, found through a sequence's block table), the prefill kernels'
query tile lookup, and the online-softmax step and split result. Inlined into each kernel
by Triton; never launched on their own."""

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
def query_tile(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Where varlen query tile ``tile`` lies: (sequence, its first new token's row, its
    number of new tokens, the tile's index within the sequence). Sequence ``s`` owns tiles
    ``[cu[s] // BLOCK_Q + s, cu[s+1] // BLOCK_Q + s + 1)``, which always covers its
    ``ceil(q_len / BLOCK_Q)`` tiles; a tile at or past ``q_len`` has nothing to do."""
    # Last sequence whose first tile index (cu[s] // BLOCK_Q + s) is <= tile.
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid
        else:
            hi = mid - 1
    q_start = tl.load(cu_seqlens_q_ptr + lo)
    q_len = tl.load(cu_seqlens_q_ptr + lo + 1) - q_start
    return lo, q_start, q_len, tile - (q_start // BLOCK_Q + lo)


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


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile into the running softmax: scores ``s`` [M, BLOCK_N] (log2 domain,
    -inf where masked), values ``v`` [BLOCK_N, D]; returns the new max, sum and output."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def split_result(acc, m_i, l_i, v_scale):
    """A context slice's normalised output (times ``v_scale``) and log2-sum-exp; an empty
    slice (past the end of a short sequence, ``l_i == 0``) gives 0 and -inf."""
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
    return acc * (v_scale / safe_l)[:, None], lse
