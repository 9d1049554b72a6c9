"""Triton SiLU-and-mul of a fused gate/up projection (one program per row and column block).

Matches ``reference.silu_and_mul_ref``: ``silu(gate) * up`` in float32, rounded once to the
input's dtype, without the float32 temporaries the torch expression would allocate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["silu_and_mul_triton"]

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(x[:, :I]) * x[:, I:]`` (shape checked by ``kernels.ops``)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows and inter:
        grid = (rows, triton.cdiv(inter, _BLOCK))
        _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter, BLOCK=_BLOCK)
    return out
