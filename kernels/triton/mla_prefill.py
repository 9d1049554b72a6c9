"""Triton varlen prefill attention for multi-head latent attention (DeepSeek-V2/V3's MLA).

The new tokens of each sequence (a whole prompt, a chunk after cached blocks, or one decode
token in a mixed batch) attend causally over the sequence's paged one-head cache of
``[latent, rope key]`` slots: the absorbed query ``[q_latent (L), q_pe (R)]`` scores a slot
by ``q_latent . c + q_pe . k_pe`` and the value is the latent ``c`` itself.

Grid: query tiles x ``ceil(H / BLOCK_H)`` head blocks, flattened to one axis (a long
prompt's tiles outnumber a second axis's 65,535). A program takes ``BLOCK_Q`` consecutive
new tokens of one sequence times a block of ``BLOCK_H`` query heads, flattened to
``BLOCK_Q * BLOCK_H`` rows, and loads each latent tile once for all of them (as keys, with
the rope part as a separate, narrow tile, and again as values). The head blocks of one
query tile are neighbours in launch order, so they read the same context while it is in
L2. Query tiles are found as the generic prefill kernel finds them (``paged.query_tile``);
the grid is an upper bound from shapes only, so the host never synchronises. The output is
``[T, H, L]``: each head's weighted latent, never the rope columns.

The generic prefill kernel (``prefill.py``) pads a 576-wide slot to 1024 columns for keys
and values alike and holds every query head of a KV head in one program, which for 128
heads does not fit an sm_90 block; here keys are 512 + 64 wide, values 512, and the head
block is a launch parameter. Offsets into the cache are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton.mla_decode import check_latent_launch, supports
from pdserve.kernels.triton.paged import block_slots, online_softmax_step, query_tile, split_result

__all__ = ["paged_mla_prefill_triton", "supports", "tile_config"]

_LOG2E = 1.4426950408889634
# Context tokens per inner iteration: the latent tile [BLOCK_N, L] is the shared memory that
# counts (bf16, L 512: 32 KiB per pipeline stage).
BLOCK_N = 32
# Rows (tokens x heads) per program on a GPU: the float32 accumulator [rows, L] lives in
# registers (128 KiB at 64 rows of 512, spread over 8 warps). A float32 query and latent
# take 32 rows: 64 would leave almost no shared memory spare (tests/kernels/aot_compile.py).
GPU_ROWS = 64
GPU_ROWS_FLOAT32 = 32


@triton.jit
def _attend(
    q_lat,  # [BLOCK_M, L]
    q_pe,  # [BLOCK_M, R]
    m_i,  # [BLOCK_M] float32, running max (log2 domain)
    l_i,  # [BLOCK_M] float32, running sum
    acc,  # [BLOCK_M, L] float32
    q_pos,  # [BLOCK_M] absolute position of each row's token
    n0,
    seq_len,
    table,  # this sequence's block table row
    cache_ptr,
    stride_cn,
    stride_cb,
    scale_log2,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n = n0 + tl.arange(0, BLOCK_N)
    valid = n < seq_len
    block, offset = block_slots(table, n, valid, BLOCK_SIZE)
    slot = cache_ptr + block[:, None] * stride_cn + offset[:, None] * stride_cb
    c = tl.load(slot + tl.arange(0, LATENT)[None, :], mask=valid[:, None], other=0.0)
    k_pe = tl.load(slot + LATENT + tl.arange(0, ROPE)[None, :], mask=valid[:, None], other=0.0)
    if c.dtype != q_lat.dtype:  # compile-time: an int8 / e4m3 cache
        c = c.to(tl.float32).to(q_lat.dtype)
        k_pe = k_pe.to(tl.float32).to(q_lat.dtype)
    s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
    s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
    s = s * scale_log2  # [BLOCK_M, BLOCK_N]
    if CAUSAL_MASK:
        s = tl.where((n[None, :] <= q_pos[:, None]) & valid[None, :], s, float("-inf"))
    # Every row saw position 0 in the first tile (tiles run in order from 0), so its running
    # max is finite here even where this tile is wholly masked. The latent tile again, now
    # as the values.
    return online_softmax_step(s, m_i, l_i, acc, c, DOT_PRECISION)


@triton.jit(do_not_specialize=["num_seqs", "stride_bts"])
def _mla_prefill_kernel(
    q_ptr,  # [T, H, L + R]: absorbed query, then roped query
    cache_ptr,  # [N, B, 1, L + R]: latent, then rope key
    cu_seqlens_q_ptr,  # [S+1] int32
    seq_lens_ptr,  # [S] int32, context incl. the new tokens
    block_tables_ptr,  # [S, M] int32
    out_ptr,  # [T, H, L] in q's dtype
    kv_scale_ptr,  # [1] float32 (QUANT)
    num_seqs,
    num_heads,
    head_blocks,  # ceil(num_heads / BLOCK_H)
    scale_log2,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_cn,
    stride_cb,
    stride_bts,
    stride_ot,
    stride_oh,
    LATENT: tl.constexpr,  # L, a power of two (512)
    ROPE: tl.constexpr,  # R, a power of two (64)
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # paged block size
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,  # int8 / float8 cache: one scale for the latent as key and value
):
    head_block = tl.program_id(0) % head_blocks
    # Reversed so the tiles with the most keys (the ends of long prompts) start first.
    tile = tl.num_programs(0) // head_blocks - 1 - tl.program_id(0) // head_blocks
    seq, q_start, q_len, local = query_tile(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q)
    if local * BLOCK_Q >= q_len:
        return
    kv_scale = 1.0
    if QUANT:
        kv_scale = tl.load(kv_scale_ptr)
        scale_log2 = scale_log2 * kv_scale
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # positions already cached before the new tokens

    r = tl.arange(0, BLOCK_Q * BLOCK_H)
    tok = local * BLOCK_Q + r // BLOCK_H  # token index within the sequence's new tokens
    head = head_block * BLOCK_H + r % BLOCK_H
    row_mask = (tok < q_len) & (head < num_heads)
    q_pos = prefix + tok
    row_off = (q_start + tok).to(tl.int64)
    dl = tl.arange(0, LATENT)
    q_row = q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(q_row + dl[None, :], mask=row_mask[:, None], other=0.0)
    q_pe = tl.load(q_row + LATENT + tl.arange(0, ROPE)[None, :], mask=row_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, LATENT], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    # Keys before the tile's first query position are visible to every row: no mask needed.
    first_pos = prefix + local * BLOCK_Q
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    last_pos = tl.minimum(prefix + (local + 1) * BLOCK_Q, seq_len)  # exclusive
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend(
            q_lat, q_pe, m_i, l_i, acc, q_pos, n0, seq_len, table, cache_ptr, stride_cn,
            stride_cb, scale_log2, LATENT, ROPE, BLOCK_N, BLOCK_SIZE, False, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, last_pos, BLOCK_N):
        m_i, l_i, acc = _attend(
            q_lat, q_pe, m_i, l_i, acc, q_pos, n0, seq_len, table, cache_ptr, stride_cn,
            stride_cb, scale_log2, LATENT, ROPE, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION,
        )  # fmt: skip

    out, _ = split_result(acc, m_i, l_i, kv_scale)
    tl.store(
        out_ptr + row_off[:, None] * stride_ot + head[:, None] * stride_oh + dl[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


def tile_config(num_heads: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int]:
    """(heads per block, query tokens per block, num_warps) the launcher picks.

    On a GPU a program holds ``GPU_ROWS`` rows: as many heads as there are up to all the
    rows (one token each at DeepSeek-V3's 128 heads, so the single query rows of decode
    sequences in a mixed batch waste nothing), the rest as tokens. The interpreter takes 64
    rows as 16 heads x 4 tokens, so a partial head block and several tokens per program are
    both exercised."""
    if device.type != "cuda":
        return 16, 4, 4
    rows = GPU_ROWS if dtype.itemsize <= 2 else GPU_ROWS_FLOAT32
    block_h = min(rows, max(16, triton.next_power_of_2(num_heads)))
    return block_h, rows // block_h, 8


def paged_mla_prefill_triton(
    q: torch.Tensor,  # [T, H, L + R]
    cache: torch.Tensor,  # [N, B, 1, L + R]
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32, context incl. the new tokens
    block_tables: torch.Tensor,  # [S, M] int32
    scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,  # [1] float32: int8 / float8 caches only
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:  # [T, H, L]
    """MLA prefill: each new token's and head's softmax-weighted latent over its causal paged
    context (``tile`` = (heads per block, tokens per block, num_warps) overrides
    ``tile_config``; tests and the device check use it)."""
    num_tokens, num_heads, _ = q.shape
    rope, quant = check_latent_launch(q, cache, kv_lora_rank, kv_scale)
    block_size = cache.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_h, block_q, num_warps = tile or tile_config(num_heads, q.dtype, q.device)
    if block_h * block_q < 16:
        raise ValueError(f"tile: {block_h} heads x {block_q} tokens, under a tl.dot's 16 rows")
    num_tiles = num_tokens // block_q + num_seqs
    head_blocks = triton.cdiv(num_heads, block_h)
    _mla_prefill_kernel[(num_tiles * head_blocks,)](
        q,
        cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        out,
        kv_scale if quant else seq_lens,
        num_seqs,
        num_heads,
        head_blocks,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        LATENT=kv_lora_rank,
        ROPE=rope,
        BLOCK_H=block_h,
        BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N,
        BLOCK_SIZE=block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        QUANT=quant,
        num_warps=num_warps,
    )
    return out
