"""Triton GEMMs over int8 / float8 weights with per-token, per-channel and group scales.

- ``int8_w8a8_gemm``: int8 activations (per-token scales) x int8 weights (per-channel
  scales), int32 sums on the tensor cores, both scales and the bias applied in float32.
- ``dequant_gemm``: float activations x int8 / float8 weights with [N, G] scales (per
  channel, per group, or a 128x128 block scale repeated over its rows): each weight tile is
  scaled in registers and multiplied in the activations' dtype, so global memory is read
  at one byte per weight.

References: ``pdserve.kernels.quant_reference.w8a8_linear`` / ``weight_only_linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["dequant_gemm", "int8_w8a8_gemm"]


def _blocks(m: int) -> tuple[int, int, int]:
    # Small M (decode) wants narrow row tiles; tl.dot needs every tile dim >= 16.
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 64, 64


@triton.jit
def _tile(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output rows and columns."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn


@triton.jit
def _load_a(a_ptr, rm, kk, M, K, stride_am):
    """The activation tile [BLOCK_M, BLOCK_K] of rows ``rm``, columns ``kk`` (0 outside)."""
    return tl.load(
        a_ptr + rm[:, None] * stride_am + kk[None, :],
        mask=(rm[:, None] < M) & (kk[None, :] < K),
        other=0,
    )


@triton.jit
def _store_c(c_ptr, out, bias_ptr, rm, rn, M, N, stride_cm, HAS_BIAS: tl.constexpr):
    """``out`` [BLOCK_M, BLOCK_N] float32 plus the bias, in c's dtype."""
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(
        c_ptr + rm[:, None] * stride_cm + rn[None, :],
        out.to(c_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def _int8_w8a8_kernel(
    a_ptr,  # [M, K] int8
    a_scale_ptr,  # [M] float32
    b_ptr,  # [N, K] int8
    b_scale_ptr,  # [N] float32
    bias_ptr,  # [N] float32 (unused without HAS_BIAS)
    c_ptr,  # [M, N] out dtype
    M,
    N,
    K: tl.constexpr,  # a layer's width: few distinct values, and a static loop bound
    stride_am,
    stride_bn,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm, rn = _tile(BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = _load_a(a_ptr, rm, kk, M, K, stride_am)
        b = tl.load(
            b_ptr + rn[None, :] * stride_bn + kk[:, None],
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0,
        )
        acc += tl.dot(a, b, out_dtype=tl.int32)
    a_s = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    b_s = tl.load(b_scale_ptr + rn, mask=rn < N, other=0.0)
    out = acc.to(tl.float32) * a_s[:, None] * b_s[None, :]
    _store_c(c_ptr, out, bias_ptr, rm, rn, M, N, stride_cm, HAS_BIAS)


@triton.jit
def _dequant_gemm_kernel(
    a_ptr,  # [M, K] float16 | bfloat16 | float32
    b_ptr,  # [N, K] int8 | float8e4nv
    b_scale_ptr,  # [N, G] float32
    bias_ptr,  # [N] float32 (unused without HAS_BIAS)
    c_ptr,  # [M, N] a's dtype
    M,
    N,
    K: tl.constexpr,  # a layer's width: few distinct values, and a static loop bound
    G,
    GROUP,  # input columns per scale group
    stride_am,
    stride_bn,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    B_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm, rn = _tile(BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = _load_a(a_ptr, rm, kk, M, K, stride_am)
        b_mask = (rn[None, :] < N) & (kk[:, None] < K)
        b = tl.load(b_ptr + rn[None, :] * stride_bn + kk[:, None], mask=b_mask, other=0)
        if B_FP8:  # float8 weights travel as their bytes
            b = b.to(tl.float8e4nv, bitcast=True)
        s = tl.load(b_scale_ptr + rn[None, :] * G + kk[:, None] // GROUP, mask=b_mask, other=0.0)
        w = (b.to(tl.float32) * s).to(a.dtype)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w, out_dtype=tl.float32)
    _store_c(c_ptr, acc, bias_ptr, rm, rn, M, N, stride_cm, HAS_BIAS)


def _check(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int]:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"want a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if scale.dim() != 2 or scale.shape[0] != b.shape[0]:
        raise ValueError(f"want scales [N, G], got {tuple(scale.shape)} for N={b.shape[0]}")
    return a.shape[0], b.shape[0], a.shape[1]


def int8_w8a8_gemm(
    a: torch.Tensor,  # [M, K] int8
    a_scale: torch.Tensor,  # [M, 1] float32
    b: torch.Tensor,  # [N, K] int8
    b_scale: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None,  # [N] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] out_dtype
    m, n, k = _check(a, b, b_scale)
    if a.dtype != torch.int8 or b.dtype != torch.int8 or b_scale.shape[1] != 1:
        raise ValueError(
            f"int8_w8a8_gemm: want int8 a and b and per-channel scales, got {a.dtype}, "
            f"{b.dtype}, scales {tuple(b_scale.shape)}"
        )
    a, b = a.contiguous(), b.contiguous()
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    bm, bn, bk = _blocks(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int8_w8a8_kernel[grid](
        a,
        a_scale.reshape(-1).float().contiguous(),
        b,
        b_scale.reshape(-1).float().contiguous(),
        bias if bias is not None else c,
        c,
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        c.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return c


def dequant_gemm(
    a: torch.Tensor,  # [M, K] float16 | bfloat16 | float32
    b: torch.Tensor,  # [N, K] int8 | float8_e4m3fn
    b_scale: torch.Tensor,  # [N, G] float32
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] a.dtype
    m, n, k = _check(a, b, b_scale)
    a, b = a.contiguous(), b.contiguous()
    scale = b_scale.float().contiguous()
    g = scale.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    bm, bn, bk = _blocks(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    fp8 = b.dtype == torch.float8_e4m3fn
    _dequant_gemm_kernel[grid](
        a,
        b.view(torch.uint8) if fp8 else b,
        scale,
        bias if bias is not None else c,
        c,
        m,
        n,
        k,
        g,
        -(-k // g),
        a.stride(0),
        b.stride(0),
        c.stride(0),
        HAS_BIAS=bias is not None,
        B_FP8=fp8,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return c
