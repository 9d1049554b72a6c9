"""Triton activations of a fused gate/up projection (one program per row and column block).

``silu_and_mul_triton`` matches ``reference.silu_and_mul_ref``: ``silu(gate) * up`` in
float32, rounded once to the input's dtype, without the float32 temporaries the torch
expression would allocate. ``clamped_swiglu_triton`` is gpt-oss's expert activation, matching
``moe_reference.moe_activation_ref`` the same way; both are one kernel (``CLAMPED``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["clamped_swiglu_triton", "silu_and_mul_triton"]

_BLOCK = 1024


@triton.jit
def _gated_activation_kernel(
    x_ptr,  # [T, 2I]: gate columns, then up columns
    out_ptr,  # [T, I]
    stride_x,
    stride_o,
    inter,
    alpha,  # CLAMPED only: the sigmoid's gain
    limit,  # CLAMPED only: gate <= limit, |up| <= limit
    CLAMPED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _gated_activation(x: torch.Tensor, alpha: float, limit: float, clamped: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows and inter:
        grid = (rows, triton.cdiv(inter, _BLOCK))
        _gated_activation_kernel[grid](
            x, out, x.stride(0), out.stride(0), inter, alpha, limit, CLAMPED=clamped, BLOCK=_BLOCK
        )
    return out


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(x[:, :I]) * x[:, I:]`` (shape checked by ``kernels.ops``)."""
    return _gated_activation(x, 1.0, 0.0, clamped=False)


def clamped_swiglu_triton(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``:
    ``[T, 2I] -> [T, I]``."""
    return _gated_activation(x, alpha, limit, clamped=True)
