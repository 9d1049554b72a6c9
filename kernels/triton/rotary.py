"""Triton neox-style rotary embedding (rotate_half, as HF Llama/Qwen2), one program per token.

Reads the token's cos/sin row from the ``[P, D]`` cache (cos in the first half, sin in the
second), rotates every query and key head in float32 and writes new tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["apply_rotary_triton"]


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    token,
    cos,  # [1, BLOCK_HALF] float32
    sin,  # [1, BLOCK_HALF] float32
    half_mask,  # [1, BLOCK_HALF]
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & half_mask
    src = src_ptr + token * stride_st + heads * stride_sh + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * stride_dt + heads * stride_dh + cols
    ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T] int64
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    cos_sin_ptr,  # [P, D]
    q_out_ptr,  # [T, Hq, D]
    k_out_ptr,  # [T, Hkv, D]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    half_mask = cols < HALF
    row = cos_sin_ptr + pos * stride_cache
    cos = tl.load(row + cols, mask=half_mask, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + cols, mask=half_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, cos, sin,
        half_mask, NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, cos, sin,
        half_mask, NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF,
    )  # fmt: skip


def apply_rotary_triton(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [P, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions; returns new contiguous tensors."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q_out, k_out
