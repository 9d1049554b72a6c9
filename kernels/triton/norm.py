"""Triton RMSNorm with an optional fused residual add (one program per row).

Matches ``reference.rms_norm_ref`` (HF Llama semantics): the residual sum is rounded to the
input dtype, the variance is taken in float32, the normalised row is rounded to the input
dtype before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm_triton"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H] (unused unless HAS_RESIDUAL)
    weight_ptr,  # [H]
    out_ptr,  # [T, H]
    residual_out_ptr,  # [T, H]: x + residual (unused unless HAS_RESIDUAL)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / hidden
    normed = (xf * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with ``residual`` returns ``(norm(x + residual), x + residual)``."""
    hidden = x.shape[-1]
    shape = x.shape
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty_like(x2)
    if residual is not None:
        r2 = residual.reshape(-1, hidden).to(x.dtype)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        residual_out = torch.empty_like(x2)
    else:
        r2 = residual_out = x2  # unused by the kernel
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            residual_out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            residual_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_H=triton.next_power_of_2(hidden),
            num_warps=max(1, min(16, triton.next_power_of_2(hidden) // 256)),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), residual_out.view(shape)
