"""Triton paged decode attention for multi-head latent attention (DeepSeek-V2/V3's MLA).

Every query head attends the same one-head cache of ``[latent, rope key]`` slots: the
absorbed query ``[q_latent (L), q_pe (R)]`` scores a slot by ``q_latent . c + q_pe . k_pe``
and the value is the latent ``c`` itself. Grid ``(S, ceil(H / BLOCK_H), splits)``: each
program takes a block of query heads and one slice of a sequence's context, loads each
latent tile once for the whole head block (as keys and as values; the rope part is a
separate, narrow tile), and keeps an online softmax; with several splits the generic
decode kernel's log-sum-exp merge (``decode.merge_splits``) combines the slices.
The output is ``[S, H, L]``: each head's weighted latent, never the rope columns.

The generic MQA kernel (``decode.py``) holds every query head of a KV head in one program,
which for 128 heads of a 576-wide slot does not fit an sm_90 block's shared memory; here
the head block is a launch parameter. Offsets into the cache are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.kv_quant import is_quantized_kv
from pdserve.kernels.triton.decode import (
    SPLIT_BUCKETS,
    _choose_splits,
    merge_splits,
    split_buffers,
)
from pdserve.kernels.triton.paged import block_slots, online_softmax_step, split_result

__all__ = ["check_latent_launch", "paged_mla_decode_triton", "supports", "warm_up_mla"]

_LOG2E = 1.4426950408889634
# Query heads per program: one tl.dot M tile. The latent tile [BLOCK_N, L] is the shared
# memory that counts (bf16, L 512: 32 KiB per pipeline stage at BLOCK_N 32).
BLOCK_H = 16
BLOCK_N = 32


@triton.jit(do_not_specialize=["stride_bts"])
def _mla_decode_kernel(
    q_ptr,  # [S, H, L + R]: absorbed query, then roped query
    cache_ptr,  # [N, B, 1, L + R]: latent, then rope key
    block_tables_ptr,  # [S, M] int32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # SPLITS == 1: [S, H, L] in q's dtype; else [S, H, SPLITS, L] float32
    lse_ptr,  # [S, H, SPLITS] float32 (log2 domain); unused when SPLITS == 1
    kv_scale_ptr,  # [1] float32 (QUANT)
    scale_log2,  # softmax scale * log2(e)
    partition_size,  # context tokens per split, a multiple of BLOCK_N
    num_heads,
    stride_qs,
    stride_qh,
    stride_cn,
    stride_cb,
    stride_bts,
    stride_os,
    stride_oh,
    stride_osplit,
    stride_ls,
    stride_lh,
    LATENT: tl.constexpr,  # L, a power of two (512)
    ROPE: tl.constexpr,  # R, a power of two (64)
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # paged block size
    BLOCK_N: tl.constexpr,  # context tokens per inner iteration
    SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,  # int8 / float8 cache: one scale for the latent as key and value
):
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    kv_scale = 1.0
    if QUANT:
        kv_scale = tl.load(kv_scale_ptr)
        scale_log2 = scale_log2 * kv_scale
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    dl = tl.arange(0, LATENT)
    dr = tl.arange(0, ROPE)
    q_row = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + dl[None, :], mask=h_mask[:, None], other=0.0)  # [BLOCK_H, L]
    q_pe = tl.load(q_row + LATENT + dr[None, :], mask=h_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT], tl.float32)
    table = block_tables_ptr + seq * stride_bts
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        block, offset = block_slots(table, n, valid, BLOCK_SIZE)
        slot = cache_ptr + block[:, None] * stride_cn + offset[:, None] * stride_cb
        c = tl.load(slot + dl[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, L]
        k_pe = tl.load(slot + LATENT + dr[None, :], mask=valid[:, None], other=0.0)
        if c.dtype != q_lat.dtype:  # compile-time: an int8 / e4m3 cache
            c = c.to(tl.float32).to(q_lat.dtype)
            k_pe = k_pe.to(tl.float32).to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
        # The latent tile again, now as the values.
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, c, DOT_PRECISION)

    out, lse = split_result(acc, m_i, l_i, kv_scale)
    o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + dl[None, :]
    if SPLITS == 1:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:
        tl.store(o_ptrs + split * stride_osplit, out, mask=h_mask[:, None])
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=h_mask)


def supports(kv_lora_rank: int, rope: int) -> bool:
    """Whether the kernel takes these widths: powers of two of at least 16 (a ``tl.dot``'s
    smallest K)."""
    return all(w >= 16 and not w & (w - 1) for w in (kv_lora_rank, rope))


def check_latent_launch(
    q: torch.Tensor,  # [*, H, L + R]
    cache: torch.Tensor,  # [N, B, 1, L + R]
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None,
) -> tuple[int, bool]:
    """Validate an MLA kernel launch (this module's or ``mla_prefill``'s); returns the rope
    width and whether the cache is quantized."""
    width = q.shape[-1]
    rope = width - kv_lora_rank
    if cache.shape[2] != 1 or cache.shape[3] != width:
        raise ValueError(f"cache: expected [N, B, 1, {width}], got {tuple(cache.shape)}")
    if not supports(kv_lora_rank, rope):
        raise ValueError(
            f"kv_lora_rank {kv_lora_rank} and rope width {rope}: the kernel needs powers of "
            "two of at least 16"
        )
    if cache.stride(-1) != 1:
        raise ValueError("cache: the slot axis must be contiguous")
    quant = is_quantized_kv(cache.dtype)
    if quant and kv_scale is None:
        raise ValueError(f"kv_scale: a {cache.dtype} cache needs its scale")
    return rope, quant


def paged_mla_decode_triton(
    q: torch.Tensor,  # [S, H, L + R]
    cache: torch.Tensor,  # [N, B, 1, L + R]
    block_tables: torch.Tensor,  # [S, M] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,  # [1] float32: int8 / float8 caches only
    num_splits: int | None = None,
    block_h: int = BLOCK_H,
    num_warps: int = 4,
) -> torch.Tensor:  # [S, H, L]
    """MLA decode: each head's softmax-weighted latent (``num_splits`` overrides the
    heuristic, tests use it; ``block_h`` / ``num_warps`` are the tile the device check
    compares)."""
    num_seqs, num_heads, _ = q.shape
    rope, quant = check_latent_launch(q, cache, kv_lora_rank, kv_scale)
    block_size = cache.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(num_seqs, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    head_blocks = triton.cdiv(num_heads, block_h)
    max_context = block_tables.shape[1] * block_size
    splits, _ = _choose_splits(num_seqs, head_blocks, max_context, q.device)
    partition = triton.cdiv(triton.cdiv(max_context, splits), BLOCK_N) * BLOCK_N
    if num_splits is not None:
        partition = triton.cdiv(triton.cdiv(max_context, num_splits), BLOCK_N) * BLOCK_N
        splits = max(1, triton.cdiv(max_context, partition))
    partial, lse, p_strides, l_strides = split_buffers(out, splits)
    _mla_decode_kernel[(num_seqs, head_blocks, splits)](
        q,
        cache,
        block_tables,
        seq_lens,
        partial,
        lse,
        kv_scale if quant else seq_lens,
        scale * _LOG2E,
        partition,
        num_heads,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        *p_strides,
        *l_strides,
        LATENT=kv_lora_rank,
        ROPE=rope,
        BLOCK_H=block_h,
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        SPLITS=splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        QUANT=quant,
        num_warps=num_warps,
    )
    merge_splits(partial, lse, out, splits)
    return out


def warm_up_mla(
    num_heads: int,
    kv_lora_rank: int,
    slot_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Compile every split bucket of the MLA decode kernel for this model before serving;
    returns how many calls were made."""
    ctx_blocks = triton.cdiv(256 * SPLIT_BUCKETS[-1], block_size)
    cache = torch.zeros(ctx_blocks, block_size, 1, slot_dim, dtype=dtype, device=device)
    q = torch.zeros(1, num_heads, slot_dim, dtype=dtype, device=device)
    table = torch.arange(ctx_blocks, dtype=torch.int32, device=device)[None, :]
    lens = torch.full((1,), ctx_blocks * block_size, dtype=torch.int32, device=device)
    for splits in SPLIT_BUCKETS:
        paged_mla_decode_triton(q, cache, table, lens, 1.0, kv_lora_rank, num_splits=splits)
    return len(SPLIT_BUCKETS)
