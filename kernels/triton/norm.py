"""Triton RMSNorm with an optional fused residual add (one program per row).

Matches ``reference.rms_norm_ref``: the residual sum is taken in float32 and stored in the
residual's dtype (float32 in the model: the stream is never rounded to bf16), the variance
is float32, and ``weight * x / rms`` is computed in float32 and rounded once to the output's
dtype.
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
    residual_out_ptr,  # [T, H] residual's dtype: x + residual (unused unless HAS_RESIDUAL)
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
    xf = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        summed = (xf + res.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, summed, mask=mask)
        xf = summed.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * (xf * tl.rsqrt(variance + eps))
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with ``residual`` returns ``(norm(x + residual), x + residual)``, the sum in
    the residual's dtype and the output in ``out_dtype`` (default x's)."""
    hidden = x.shape[-1]
    shape = x.shape
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        residual_out = torch.empty_like(r2)
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
