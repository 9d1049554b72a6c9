"""Triton paged decode attention (flash-decoding): one query token per sequence.

Grid ``(S, Hkv, splits)``: each program loads one KV head's keys/values once for the whole
query-head group sharing it (GQA/MQA) and covers one slice of the context, with an online
softmax. With several splits a second kernel merges the slices by their log-sum-exp.
The context bound comes from the block table width, so the host never reads ``seq_lens``
(no device sync). Offsets into the cache are int64.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels.kv_quant import is_quantized_kv
from pdserve.kernels.triton.paged import (
    block_slots,
    load_tile,
    online_softmax_step,
    split_result,
)

__all__ = [
    "SPLIT_BUCKETS",
    "bucket_splits",
    "merge_splits",
    "paged_decode_attention_triton",
    "split_buffers",
    "warm_up",
]

_LOG2E = 1.4426950408889634


# The block table's width changes every few steps: never a specialisation key (Triton would
# otherwise compile a variant for width 1 and for widths divisible by 16 while serving).
@triton.jit(do_not_specialize=["stride_bts"])
def _decode_split_kernel(
    q_ptr,  # [S, Hq, D]
    k_cache_ptr,  # [N, B, Hkv, D]
    v_cache_ptr,  # [N, B, Hkv, D]
    block_tables_ptr,  # [S, M] int32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # SPLITS == 1: [S, Hq, D] in q's dtype; else [S, Hq, SPLITS, D] float32
    lse_ptr,  # [S, Hq, SPLITS] float32 (log2 domain); unused when SPLITS == 1
    k_scale_ptr,  # [Hkv] float32 (QUANT)
    v_scale_ptr,  # [Hkv] float32 (QUANT)
    scale_log2,  # softmax scale * log2(e)
    partition_size,  # context tokens per split, a multiple of BLOCK_N
    stride_qs,
    stride_qh,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    stride_bts,
    stride_os,
    stride_oh,
    stride_osplit,
    stride_ls,
    stride_lh,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16 so tl.dot has a legal M
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # paged block size
    BLOCK_N: tl.constexpr,  # context tokens per inner iteration
    SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,  # int8 / float8 cache: K's scale joins the softmax scale, V's the output
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    v_scale = 1.0
    if QUANT:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    d_mask = d < HEAD_DIM
    q_mask = (g < GROUP)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=q_mask)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bts
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        block, offset = block_slots(table, n, valid, BLOCK_SIZE)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = load_tile(
            k_cache_ptr, block, offset, kv_head, d, kv_mask, stride_kn, stride_kb, stride_kh
        )
        v = load_tile(
            v_cache_ptr, block, offset, kv_head, d, kv_mask, stride_vn, stride_vb, stride_vh
        )
        if k.dtype != q.dtype:  # compile-time: an int8 / e4m3 cache
            # Exact through float32 into q's dtype (the interpreter mis-casts int8 to bf16).
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, DOT_PRECISION)

    out, lse = split_result(acc, m_i, l_i, v_scale)
    o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :]
    if SPLITS == 1:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        tl.store(o_ptrs + split * stride_osplit, out, mask=q_mask)
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=g < GROUP)


@triton.jit
def _decode_reduce_kernel(
    partial_ptr,  # [S, Hq, SPLITS, D] float32
    lse_ptr,  # [S, Hq, SPLITS] float32
    out_ptr,  # [S, Hq, D]
    stride_ps,
    stride_ph,
    stride_psplit,
    stride_ls,
    stride_lh,
    stride_os,
    stride_oh,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    sp_mask = sp < SPLITS
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + sp, mask=sp_mask, other=-1e30)
    lse = tl.where(lse == float("-inf"), -1e30, lse)  # empty slices weigh exactly 0
    weight = tl.exp2(lse - tl.max(lse, 0))
    weight = tl.where(lse > -1e30, weight, 0.0)
    total = tl.sum(weight, 0)
    weight = weight / tl.where(total > 0, total, 1.0)
    parts = tl.load(
        partial_ptr + seq * stride_ps + head * stride_ph + sp[:, None] * stride_psplit + d[None, :],
        mask=sp_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# SPLITS is a compile-time constant: the heuristic picks from these buckets only, so a
# serving replica compiles (and warms up, ``warm_up``) a handful of variants, never one per
# batch size / context length.
SPLIT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_splits(wanted: int) -> int:
    """The smallest bucket >= ``wanted`` (the largest bucket past it)."""
    return next((b for b in SPLIT_BUCKETS if b >= wanted), SPLIT_BUCKETS[-1])


def _choose_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device):
    """(splits, block_n): enough programs to fill the GPU, >= 256 tokens per split,
    rounded up to a bucket (``SPLIT_BUCKETS``)."""
    block_n = 64
    if device.type == "cuda":
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:  # interpreter runs: any value gives correct results
        sms = 4
    base = num_seqs * num_kv_heads
    wanted = max(1, triton.cdiv(2 * sms, base))
    splits = max(1, min(wanted, triton.cdiv(max_context, 256), SPLIT_BUCKETS[-1]))
    return bucket_splits(splits), block_n


def paged_decode_attention_triton(
    q: torch.Tensor,  # [S, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    block_tables: torch.Tensor,  # [S, M] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    k_scale: torch.Tensor | None = None,  # [Hkv] float32: int8 / float8 caches only
    v_scale: torch.Tensor | None = None,  # [Hkv] float32
) -> torch.Tensor:  # [S, Hq, D]
    """Decode attention (an int8 / float8 cache dequantized with its per-head scales);
    ``num_splits`` overrides the heuristic (tests use it). With a window, softcap or sinks
    the batch goes to the varlen kernel of ``prefill.py`` as one-token sequences (it
    implements them; few models use them, so this kernel stays lean)."""
    if sliding_window or softcap or sinks is not None:
        from pdserve.kernels.triton.prefill import paged_attention_triton

        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return paged_attention_triton(
            q, k_cache, v_cache, cu, seq_lens, block_tables, scale,
            sliding_window=sliding_window, softcap=softcap, sinks=sinks,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    quant = is_quantized_kv(k_cache.dtype)
    if quant and (k_scale is None or v_scale is None):
        raise ValueError(f"k_scale/v_scale: a {k_cache.dtype} cache needs its scales")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head_dim axis must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    # The kernel indexes these densely as int32 (no-ops for the usual inputs).
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    splits, block_n = _choose_splits(num_seqs, num_kv_heads, max_context, q.device)
    partition = triton.cdiv(triton.cdiv(max_context, splits), block_n) * block_n
    if num_splits is not None:  # an explicit count (tests): only as many as cover the context
        partition = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
        splits = max(1, triton.cdiv(max_context, partition))
    # Else the bucket stands even where fewer splits would cover the context: trailing
    # splits are empty (the merge gives them no weight), and the constant stays a bucket.
    block_d = triton.next_power_of_2(head_dim)
    partial, lse, p_strides, l_strides = split_buffers(out, splits)
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        partial,
        lse,
        k_scale if quant else seq_lens,
        v_scale if quant else seq_lens,
        scale * _LOG2E,
        partition,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        *p_strides,
        *l_strides,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLITS=splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        QUANT=quant,
        num_warps=4,
    )
    merge_splits(partial, lse, out, splits)
    return out


Strides = tuple[int, ...]


def split_buffers(
    out: torch.Tensor,  # [S, H, D]
    splits: int,
) -> tuple[torch.Tensor, torch.Tensor, Strides, Strides]:
    """Where a split kernel writes: ``out`` itself for one split, else float32 partial
    outputs ``[S, H, splits, D]`` and their log-sum-exps ``[S, H, splits]``; with the
    (sequence, head, split) and (sequence, head) strides the kernels take."""
    if splits == 1:
        return out, out, (out.stride(0), out.stride(1), 0), (0, 0)  # lse unused
    num_seqs, num_heads, head_dim = out.shape
    partial = torch.empty(
        num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=out.device
    )
    lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=out.device)
    p_strides = (partial.stride(0), partial.stride(1), partial.stride(2))
    return partial, lse, p_strides, (lse.stride(0), lse.stride(1))


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, splits: int) -> None:
    """Merge the splits of ``split_buffers`` into ``out`` by their log-sum-exps (nothing to
    do for one split)."""
    if splits == 1:
        return
    num_seqs, num_heads, head_dim = out.shape
    _decode_reduce_kernel[(num_seqs, num_heads)](
        partial,
        lse,
        out,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def warm_up(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Compile every variant the heuristic can pick for this model (one per split bucket)
    before serving; returns how many calls were made."""
    ctx_blocks = triton.cdiv(256 * SPLIT_BUCKETS[-1], block_size)
    k = torch.zeros(ctx_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    table = torch.arange(ctx_blocks, dtype=torch.int32, device=device)[None, :]
    lens = torch.full((1,), ctx_blocks * block_size, dtype=torch.int32, device=device)
    for splits in SPLIT_BUCKETS:
        paged_decode_attention_triton(q, k, k, table, lens, 1.0, num_splits=splits)
    return len(SPLIT_BUCKETS)
