"""Triton fused mixture-of-experts: the step's (token, expert) pairs sorted by expert into
row blocks of one expert each, and every expert's GEMM run once over its blocks.

``align_by_expert`` sorts the pairs and pads each expert's run to a multiple of
``BLOCK_M`` rows, all with device-side torch ops (no host synchronisation, so a CUDA graph
can capture it): the padded length is bounded by ``pairs + min(E, pairs) * (BLOCK_M - 1)``
and blocks past the used ones are marked -1 and exit at once. ``_moe_gemm_kernel`` is a
grouped GEMM: each program loads one expert's weight tile and the (gathered) rows of its
block. It runs twice: gate/up over the token rows (``A_DIV`` = top-k: a pair's row is its
token's), the activation between (SiLU-and-mul, or gpt-oss's clamped SwiGLU), then down
over the pair rows, each GEMM plus its expert's bias when the model has one (``HAS_BIAS``),
the down projection's output scaled by the routing weight
and written in float32 at the pair's own index, so the sum over a token's experts is a
plain reduction (no atomics, deterministic). Matches ``kernels/moe_reference.fused_moe_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.moe_reference import ClampedSwiGLU
from pdserve.kernels.triton.activation import clamped_swiglu_triton, silu_and_mul_triton

__all__ = ["align_by_expert", "fused_moe_triton"]

BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [Ra, K]: the row of pair p is p // A_DIV
    w_ptr,  # [E, N, K]
    bias_ptr,  # [E, N]: each expert's bias (read if HAS_BIAS)
    out_ptr,  # [P, N]: row p is pair p's
    route_w_ptr,  # [P] float32: routing weight of each pair (read if MUL_WEIGHT)
    sorted_ids_ptr,  # [R] int32: pair at each padded sorted row; >= num_pairs is padding
    block_expert_ptr,  # [R // BLOCK_M] int32: expert of each row block, -1 if unused
    num_pairs,
    n,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    K: tl.constexpr,  # hidden or expert intermediate size: one compile per layer shape
    A_DIV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    a_row = (pair // A_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_base = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + a_row[:, None] * stride_am + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(route_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_m_for(num_pairs: int) -> int:
    """Rows per block: small for decode-sized steps (little padding per expert)."""
    return 16 if num_pairs <= 1024 else 64


def align_by_expert(
    topk_ids: torch.Tensor,  # [T, K] int64
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [R] int32, block_expert [R // block_m] int32): the pairs grouped by
    expert, each expert's run padded to ``block_m`` rows (padding rows hold ``T * K``)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs, dev = flat.numel(), flat.device
    # scatter_add, not bincount: bincount on CUDA reads the maximum back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]
    capacity = pairs + min(num_experts, pairs) * (block_m - 1)
    capacity = triton.cdiv(capacity, block_m) * block_m
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=dev)
    sorted_ids[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids, block_expert.to(torch.int32)


def _grouped_gemm(
    a: torch.Tensor,  # [Ra, K]
    w: torch.Tensor,  # [E, N, K]
    bias: torch.Tensor | None,  # [E, N]
    out: torch.Tensor,  # [P, N]
    route_w: torch.Tensor,  # [P] float32
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    a_div: int,
    mul_weight: bool,
    block_m: int,
) -> None:
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    bias_arg = w if bias is None else bias  # never read without HAS_BIAS
    _moe_gemm_kernel[grid](
        a, w, bias_arg, out, route_w, sorted_ids, block_expert,
        out.shape[0], n,
        a.stride(0), w.stride(0), w.stride(1), bias_arg.stride(0), out.stride(0),
        K=k, A_DIV=a_div, HAS_BIAS=bias is not None, MUL_WEIGHT=mul_weight,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
    )  # fmt: skip


def fused_moe_triton(
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
    t, top_k = topk_ids.shape
    pairs = t * top_k
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    b13 = None if b13 is None else b13.contiguous()
    b2 = None if b2 is None else b2.contiguous()
    block_m = block_m_for(pairs)
    sorted_ids, block_expert = align_by_expert(topk_ids, w13.shape[0], block_m)
    route_w = topk_weights.reshape(-1).float().contiguous()
    h = torch.empty((pairs, w13.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, b13, h, route_w, sorted_ids, block_expert, top_k, False, block_m)
    if activation is None:
        act = silu_and_mul_triton(h)
    else:
        act = clamped_swiglu_triton(h, activation.alpha, activation.limit)
    y = torch.empty((pairs, w2.shape[1]), dtype=torch.float32, device=x.device)
    _grouped_gemm(act, w2, b2, y, route_w, sorted_ids, block_expert, 1, True, block_m)
    return y.view(t, top_k, -1).sum(dim=1).to(x.dtype)
