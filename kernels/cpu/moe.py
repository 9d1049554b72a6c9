"""The fused mixture-of-experts on CPU: tokens sorted by expert, each expert's GEMMs run
once per step over all of its tokens.

A step's (token, expert) pairs are sorted by expert with one stable argsort, the rows
gathered once, and each expert that received tokens multiplies its contiguous segment by
its gate/up and down weights (torch's native fp32 / bf16 GEMMs; experts with no token cost
nothing). The weighted sum over a token's experts is one batched matmul in float32, so the
result does not depend on the order the experts ran in. Matches
``kernels/moe_reference.fused_moe_ref``, expert biases and the gpt-oss activation included.
"""

from __future__ import annotations

import torch

from pdserve.kernels.cpu.batched import silu_and_mul_cpu
from pdserve.kernels.moe_reference import ClampedSwiGLU, moe_activation_ref

__all__ = ["fused_moe_cpu", "sort_by_expert"]


def sort_by_expert(
    topk_ids: torch.Tensor,  # [T, K] int64
    num_experts: int,
) -> tuple[torch.Tensor, list[int]]:
    """(order [T*K]: flat (token, slot) indices sorted by expert, stable; tokens per expert)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def _grouped_mm(
    a: torch.Tensor,  # [R, K]: rows sorted by expert
    w: torch.Tensor,  # [E, N, K]
    counts: list[int],  # [E] rows of each expert, in order
    bias: torch.Tensor | None,  # [E, N]
) -> torch.Tensor:  # [R, N]
    out = torch.empty((a.shape[0], w.shape[1]), dtype=a.dtype)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            if bias is None:
                torch.mm(a[rows], w[e].t(), out=out[rows])
            else:
                torch.addmm(bias[e], a[rows], w[e].t(), out=out[rows])
            start += n
    return out


def fused_moe_cpu(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64
    b13: torch.Tensor | None = None,  # [E, 2I]
    b2: torch.Tensor | None = None,  # [E, H]
    activation: ClampedSwiGLU | None = None,  # None: SiLU-and-mul
) -> torch.Tensor:  # [T, H] in x's dtype
    """``sum_k w[t, k] * expert_{ids[t, k]}(x_t)`` (shapes checked by ``kernels.moe_ops``)."""
    t, k = topk_ids.shape
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    rows = order // k  # the token of each sorted pair
    h = _grouped_mm(x.index_select(0, rows), w13, counts, b13)
    if activation is None:
        act = silu_and_mul_cpu(h)
    else:
        act = moe_activation_ref(h, activation).to(h.dtype)
    y_sorted = _grouped_mm(act, w2, counts, b2)
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)  # back to (token, slot)
    out = torch.bmm(topk_weights.float().unsqueeze(1), y.view(t, k, -1).float())
    return out.squeeze(1).to(x.dtype)
