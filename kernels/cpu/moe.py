"""The fused mixture-of-experts on CPU: tokens sorted by expert, each expert's GEMMs run
once per step over all of its tokens.

A step's (token, expert) pairs are sorted by expert with one stable argsort, the rows
gathered once, and each expert that received tokens multiplies its contiguous segment by
its gate/up and down weights (experts with no token cost nothing). The weighted sum over a
token's experts is one batched matmul in float32, so the result does not depend on the
order the experts ran in. Matches ``kernels/moe_reference.fused_moe_ref``, expert biases
and the gpt-oss activation included.

The expert GEMMs run on one of two weight forms:
  - the stacked ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` tensors, through torch's native fp32 /
    bf16 ``mm`` (which reorders each expert's weight for oneDNN on every call in bf16);
  - ``PackedExperts``: each expert's two weights reordered once, at load, into oneDNN's
    prepacked layout and run by ``mkldnn._linear_pointwise`` (the ops ``PackedLinear`` uses
    for the dense linears), the bias fused. ``pack_moe_experts`` does this for a loaded
    model where ``can_pack`` says so (bfloat16 on a CPU with native bf16; float32 packs too
    but measured slower than torch's own matmul at decode sizes, docs/models.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.kernels.cpu.batched import silu_and_mul_cpu
from pdserve.kernels.cpu.linear import can_pack
from pdserve.kernels.moe_reference import ClampedSwiGLU, moe_activation_ref

__all__ = ["PackedExperts", "fused_moe_cpu", "pack_moe_experts", "sort_by_expert"]

logger = logging.getLogger(__name__)


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
    w: torch.Tensor | tuple[torch.Tensor, ...],  # [E, N, K] stacked, or E packed [N, K]
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
        if isinstance(w, tuple):
            b = None if bias is None else bias[e]
            out[rows] = torch.ops.mkldnn._linear_pointwise(a[rows], w[e], b, "none", [], "")
        elif bias is None:
            torch.mm(a[rows], w[e].t(), out=out[rows])
        else:
            torch.addmm(bias[e], a[rows], w[e].t(), out=out[rows])
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
    packed: PackedExperts | None = None,  # the same weights, prepacked: run on these
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


def pack_moe_experts(model: nn.Module) -> int:
    """Pack the stacked experts of every module of ``model`` that declares a
    ``packed_experts`` attribute (None) next to its ``w13`` / ``w2`` parameters, where
    ``can_pack`` says so for their dtype and device; returns how many were packed.

    The module then holds ``PackedExperts`` and passes it to ``fused_moe``; its ``w13`` /
    ``w2`` become meta-device parameters of the same shape and dtype (the shapes stay
    readable, the unpacked copy is freed, and a read of its values fails loudly)."""
    count = 0
    for module in model.modules():
        if vars(module).get("packed_experts", "absent") is not None:  # not one, or packed
            continue
        w13, w2 = getattr(module, "w13", None), getattr(module, "w2", None)
        if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)):
            continue
        if not can_pack(w13.dtype, w13.device):
            continue
        setattr(module, "packed_experts", PackedExperts.pack(w13, w2))  # noqa: B010
        for name, param in (("w13", w13), ("w2", w2)):
            ghost = torch.empty(param.shape, dtype=param.dtype, device="meta")
            setattr(module, name, nn.Parameter(ghost, requires_grad=False))
        count += 1
    if count:
        logger.info("packed the experts of %d MoE layers for oneDNN", count)
    return count
