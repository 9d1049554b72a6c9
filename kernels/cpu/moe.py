"""The fused mixture-of-experts on CPU: tokens sorted by expert, each expert's GEMMs run
once per step over all of its tokens.

A step's (token, expert) pairs are sorted by expert with one stable argsort, the rows
gathered once, and each expert that received tokens multiplies its contiguous segment by
its gate/up and down weights (experts with no token cost nothing). The weighted sum over a
token's experts is one batched matmul in float32, so the result does not depend on the
order the experts ran in. Matches ``kernels/moe_reference.fused_moe_ref``, expert biases
and the gpt-oss activation included.

The expert GEMMs run on one of three weight forms:
  - the stacked ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` tensors, through torch's native fp32 /
    bf16 ``mm`` (which reorders each expert's weight for oneDNN on every call in bf16);
  - ``PackedExperts``: each expert's two weights reordered once, at load, into oneDNN's
    prepacked layout and run by ``mkldnn._linear_pointwise`` (the ops ``PackedLinear`` uses
    for the dense linears), the bias fused. ``moe_ops.pack_moe_experts`` does this for a loaded
    model where ``can_pack`` says so (bfloat16 on a CPU with native bf16; float32 packs too
    but measured slower than torch's own matmul at decode sizes, docs/models.md);
  - ``QuantizedExperts``: each expert's two weights quantized to int8 per output channel and
    held by the int8 linear kernels (``kernels/cpu/quant_linear.py``), for a model quantized
    at load (``kernels.moe_ops.quantize_experts``); the bias is added after each segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.kernels.cpu.batched import silu_and_mul_cpu
from pdserve.kernels.moe_reference import ClampedSwiGLU, moe_activation_ref

__all__ = ["PackedExperts", "QuantizedExperts", "fused_moe_cpu", "sort_by_expert"]


@dataclass(frozen=True)
class PackedExperts:
    """Each expert's ``[2I, H]`` gate/up and ``[H, I]`` down weight in oneDNN's prepacked
    layout (CPU, inference only); build with ``PackedExperts.pack``."""

    w13: tuple[torch.Tensor, ...]  # E x packed [2I, H]
    w2: tuple[torch.Tensor, ...]  # E x packed [H, I]
    shape: tuple[int, int, int]  # (E, 2I, H) of the stacked w13 it was packed from
    dtype: torch.dtype

    @classmethod
    def pack(cls, w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts:
        """Pack stacked ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (float32 or bfloat16, CPU)."""
        if w13.device.type != "cpu" or w13.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"PackedExperts: want float32 or bfloat16 CPU weights, got {w13.dtype} on "
                f"{w13.device}"
            )
        if w13.dim() != 3 or w2.dim() != 3 or w2.dtype != w13.dtype:
            raise ValueError("PackedExperts: w13 must be [E, 2I, H] and w2 [E, H, I], one dtype")
        e, two_i, h = w13.shape
        if two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
            raise ValueError(f"PackedExperts: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)}")
        reorder = torch.ops.mkldnn._reorder_linear_weight
        w13 = w13.detach()
        w2 = w2.detach()
        return cls(
            w13=tuple(reorder(w13[j].contiguous()) for j in range(e)),
            w2=tuple(reorder(w2[j].contiguous()) for j in range(e)),
            shape=(e, two_i, h),
            dtype=w13.dtype,
        )


@dataclass(frozen=True)
class QuantizedExperts:
    """Each expert's gate/up (``[2I, H]``) and down (``[H, I]``) projection as an int8
    kernel module without bias (inference only); built by ``moe_ops.quantize_experts``."""

    w13: tuple[nn.Module, ...]  # E modules [.., H] -> [.., 2I]
    w2: tuple[nn.Module, ...]  # E modules [.., I] -> [.., H]
    shape: tuple[int, int, int]  # (E, 2I, H) of the stacked w13 it was quantized from
    dtype: torch.dtype  # the activations' dtype


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
    w: torch.Tensor
    | tuple[torch.Tensor, ...]
    | tuple[nn.Module, ...],  # stacked [E, N, K] / E packed / E int8 modules
    n_out: int,  # N
    counts: list[int],  # [E] rows of each expert, in order
    bias: torch.Tensor | None,  # [E, N]
) -> torch.Tensor:  # [R, N]
    out = torch.empty((a.shape[0], n_out), dtype=a.dtype)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        rows = slice(start, start + n)
        if isinstance(w, torch.Tensor):  # stacked [E, N, K]
            if bias is None:
                torch.mm(a[rows], w[e].t(), out=out[rows])
            else:
                torch.addmm(bias[e], a[rows], w[e].t(), out=out[rows])
        elif isinstance(expert := w[e], nn.Module):  # QuantizedExperts
            out[rows] = expert(a[rows])
            if bias is not None:
                out[rows] += bias[e]
        else:  # PackedExperts
            b = None if bias is None else bias[e]
            out[rows] = torch.ops.mkldnn._linear_pointwise(a[rows], w[e], b, "none", [], "")
        start += n
    return out


def fused_moe_cpu(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] (shape only, where packed is given)
    w2: torch.Tensor,  # [E, H, I] (shape only, where packed is given)
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64
    b13: torch.Tensor | None = None,  # [E, 2I]
    b2: torch.Tensor | None = None,  # [E, H]
    activation: ClampedSwiGLU | None = None,  # None: SiLU-and-mul
    packed: PackedExperts | QuantizedExperts | None = None,  # the same weights: run on these
) -> torch.Tensor:  # [T, H] in x's dtype
    """``sum_k w[t, k] * expert_{ids[t, k]}(x_t)`` (shapes checked by ``kernels.moe_ops``)."""
    t, k = topk_ids.shape
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    rows = order // k  # the token of each sorted pair
    gate_up = w13 if packed is None else packed.w13
    down = w2 if packed is None else packed.w2
    h = _grouped_mm(x.index_select(0, rows), gate_up, w13.shape[1], counts, b13)
    if activation is None:
        act = silu_and_mul_cpu(h)
    else:
        act = moe_activation_ref(h, activation).to(h.dtype)
    y_sorted = _grouped_mm(act, down, w2.shape[1], counts, b2)
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)  # back to (token, slot)
    out = torch.bmm(topk_weights.float().unsqueeze(1), y.view(t, k, -1).float())
    return out.squeeze(1).to(x.dtype)
