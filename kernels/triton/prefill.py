"""Triton varlen attention over paged KV for mixed prefill/decode batches.

Handles chunked prefill and prefix-cache hits: the new tokens of a sequence are its last
``q_len`` positions, and they attend causally to everything before them, cached prefix
included, read block by block through the block table. A FlashAttention-style online softmax
keeps the score matrix to one ``[BLOCK_M, BLOCK_N]`` tile.

Grid ``(tiles, Hkv)``. A tile is ``BLOCK_Q`` consecutive query tokens of one sequence times
the ``GROUP`` query heads sharing one KV head, flattened to ``BLOCK_M = BLOCK_Q * GROUP_PAD``
rows, so each K/V tile is loaded once per head group. Sequence ``s`` owns tiles
``[cu[s] // BLOCK_Q + s, cu[s+1] // BLOCK_Q + s + 1)``, a range that always covers its
``ceil(q_len / BLOCK_Q)`` tiles; a program finds its sequence by binary search over
``cu_seqlens_q`` and exits if its tile is past the sequence's last token. The grid size is an
upper bound computed from shapes only, so the host never synchronises with the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.kv_quant import is_quantized_kv
from pdserve.kernels.triton.paged import block_slots, load_tile, query_tile

__all__ = ["paged_attention_triton"]

_LOG2E = 1.4426950408889634
_SINK_LOG2E: tl.constexpr = tl.constexpr(_LOG2E)


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, BLOCK_D]
    acc,  # [BLOCK_M, BLOCK_D] float32
    m_i,  # [BLOCK_M] float32, running max (log2 domain)
    l_i,  # [BLOCK_M] float32, running sum
    q_pos,  # [BLOCK_M] int32, absolute position of each row's token
    n0,
    seq_len,
    table,  # this sequence's block table row
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    scale_log2,
    softcap_in,  # softmax scale / softcap (HAS_SOFTCAP)
    softcap_out,  # softcap * log2(e) (HAS_SOFTCAP)
    window,  # attended positions per query (HAS_WINDOW)
    d,  # [BLOCK_D]
    d_mask,  # [BLOCK_D]
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n = n0 + tl.arange(0, BLOCK_N)
    valid = n < seq_len
    block, offset = block_slots(table, n, valid, BLOCK_SIZE)
    kv_mask = valid[:, None] & d_mask[None, :]
    k = load_tile(k_cache_ptr, block, offset, kv_head, d, kv_mask, stride_kn, stride_kb, stride_kh)
    v = load_tile(v_cache_ptr, block, offset, kv_head, d, kv_mask, stride_vn, stride_vb, stride_vh)
    if k.dtype != q.dtype:  # compile-time: an int8 / e4m3 cache
        # Exact through float32 into q's dtype (the interpreter mis-casts int8 to bf16).
        k = k.to(tl.float32).to(q.dtype)
        v = v.to(tl.float32).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        # softcap * tanh(scale * qk / softcap), tanh written with exp (no tanh in tl).
        s = softcap_out * (1.0 - 2.0 / (tl.exp(2.0 * s * softcap_in) + 1.0))
    else:
        s = s * scale_log2
    if CAUSAL_MASK:
        visible = (n[None, :] <= q_pos[:, None]) & valid[None, :]
        if HAS_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing visible yet keep m == -inf; subtract 0 instead to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_seqs", "stride_bts"])
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [N, B, Hkv, D]
    v_cache_ptr,  # [N, B, Hkv, D]
    cu_seqlens_q_ptr,  # [S+1] int32
    seq_lens_ptr,  # [S] int32
    block_tables_ptr,  # [S, M] int32
    out_ptr,  # [T, Hq, D]
    sinks_ptr,  # [Hq] float32 (HAS_SINKS)
    k_scale_ptr,  # [Hkv] float32 (QUANT)
    v_scale_ptr,  # [Hkv] float32 (QUANT)
    num_seqs,
    scale_log2,  # softmax scale * log2(e)
    softcap_in,  # softmax scale / softcap (HAS_SOFTCAP)
    softcap_out,  # softcap * log2(e) (HAS_SOFTCAP)
    window,  # attended positions per query (HAS_WINDOW)
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    stride_bts,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,  # int8 / float8 cache: K's scale joins the logit scale, V's the output
):
    # Reversed so the tiles with the most keys (the ends of long prompts) start first and
    # the cheap ones fill the tail of the schedule.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    v_scale = 1.0
    if QUANT:
        k_scale = tl.load(k_scale_ptr + kv_head)
        scale_log2 = scale_log2 * k_scale
        softcap_in = softcap_in * k_scale
        v_scale = tl.load(v_scale_ptr + kv_head)

    seq, q_start, q_len, local = query_tile(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # positions already cached before the new tokens

    r = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + r // GROUP_PAD  # token index within the sequence's new tokens
    g = r % GROUP_PAD
    row_mask = (tok < q_len) & (g < GROUP)
    q_pos = prefix + tok
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    head = kv_head * GROUP + g
    row_off = (q_start + tok).to(tl.int64)
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask,
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts

    # Keys before the tile's first query position are visible to every row: no mask needed
    # (without a window; with one, every tile from the first row's window start is masked).
    first_pos = prefix + local * BLOCK_Q
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    last_pos = tl.minimum(prefix + (local + 1) * BLOCK_Q, seq_len)  # exclusive
    if HAS_WINDOW:
        full_end = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, q_pos, n0, seq_len, table, k_cache_ptr, v_cache_ptr, kv_head,
                stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh, scale_log2,
                softcap_in, softcap_out, window, d, d_mask, BLOCK_N, BLOCK_SIZE, False,
                HAS_SOFTCAP, False, DOT_PRECISION,
            )  # fmt: skip
    for n0 in range(full_end, last_pos, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, q_pos, n0, seq_len, table, k_cache_ptr, v_cache_ptr, kv_head,
            stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh, scale_log2,
            softcap_in, softcap_out, window, d, d_mask, BLOCK_N, BLOCK_SIZE, True,
            HAS_SOFTCAP, HAS_WINDOW, DOT_PRECISION,
        )  # fmt: skip

    if HAS_SINKS:
        # The sink's logit joins each head's denominator only (gpt-oss), in the log2 domain.
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32) * _SINK_LOG2E
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        l_i = l_i + tl.exp2(sink - m_safe)
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    tl.store(
        out_ptr + row_off[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def _tile_config(
    group_pad: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for this head group size, head_dim and dtype."""
    if device.type != "cuda":  # interpreter: big tiles mean fewer (slow) program instances
        return max(64, group_pad), 64, 4
    if head_dim > 256:
        # MLA's 576-wide latent head (DeepSeek-V3): 32-key tiles of it overflow an sm_90
        # block's shared memory (tests/kernels/aot_compile.py sizes it).
        return max(64, group_pad), 16, 4
    if dtype == torch.float32 or head_dim > 128:
        # 4-byte (or long) rows: smaller tiles keep the pipelined K/V buffers in shared memory
        # on GPUs with ~100 KB of it per block.
        return max(64, group_pad), 32, 4
    return max(128, group_pad), 64, (8 if head_dim >= 128 else 4)


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [S+1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_tables: torch.Tensor,  # [S, M] int32
    scale: float,
    block_m: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    k_scale: torch.Tensor | None = None,  # [Hkv] float32: int8 / float8 caches only
    v_scale: torch.Tensor | None = None,  # [Hkv] float32
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of a variable-length batch over paged KV (optionally over the last
    ``sliding_window`` positions, logits capped at ``softcap``, ``sinks`` in the softmax
    denominator: see ``reference.paged_attention_ref``; an int8 / float8 cache dequantized
    with its per-head scales); ``block_m`` is for tests."""
    quant = is_quantized_kv(k_cache.dtype)
    if quant and (k_scale is None or v_scale is None):
        raise ValueError(f"k_scale/v_scale: a {k_cache.dtype} cache needs its scales")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head_dim axis must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    # The kernel indexes these densely as int32 (no-ops for the usual inputs).
    cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    default_m, block_n, num_warps = _tile_config(group_pad, head_dim, q.dtype, q.device)
    block_m = max(block_m or default_m, group_pad, 16)
    block_q = block_m // group_pad
    num_tiles = num_tokens // block_q + num_seqs
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        out,
        sinks.float().contiguous() if sinks is not None else out,
        k_scale if quant else out,
        v_scale if quant else out,
        num_seqs,
        scale * _LOG2E,
        scale / softcap if softcap else 0.0,
        softcap * _LOG2E if softcap else 0.0,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        HAS_SOFTCAP=bool(softcap),
        HAS_WINDOW=bool(sliding_window),
        HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        QUANT=quant,
        num_warps=num_warps,
    )
    return out
