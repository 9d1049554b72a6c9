"""Mixture-of-experts dispatch: the router (which experts each token goes to, and with what
weight) and the fused expert computation (Triton on CUDA, the sorted grouped GEMM of
``kernels/cpu/moe.py`` on CPU; both checked against ``kernels/moe_reference.py``).

The router covers the scoring rules of the open MoE families, picked by ``RouterConfig``:
  - softmax over all experts, top-k, optionally renormalised (Mixtral always renormalises;
    Qwen3-MoE when ``norm_topk_prob``);
  - top-k of the logits, softmax over those k (gpt-oss);
  - sigmoid scores, a selection-only bias, grouped top-k (the best ``topk_groups`` of
    ``num_groups`` expert groups, a group scored by its two best experts), renormalised and
    scaled by ``routed_scaling`` (DeepSeek-V3);
  - softmax scores, grouped top-k with a group scored by its best expert
    (``group_score="max"``), scaled by ``routed_scaling``, not renormalised (DeepSeek-V2's
    ``group_limited_greedy``).
Shared experts (DeepSeek-V3) ride in the same fused call: ``add_shared_experts`` routes every
token also to experts stacked after the routed ones, with weight 1 (a shared MLP of
``n * I`` columns is ``n`` experts of ``I`` columns, its down projection summing them).
The experts may carry biases and gpt-oss's clamped SwiGLU (``ClampedSwiGLU``) in place of
SiLU-and-mul. Routing is a few small torch ops over ``[T, E]`` on every device. Nothing here
keeps state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pdserve.kernels.cpu.moe import PackedExperts, fused_moe_cpu, pack_moe_experts
from pdserve.kernels.moe_reference import ClampedSwiGLU, fused_moe_ref

__all__ = [
    "ClampedSwiGLU",
    "PackedExperts",
    "RouterConfig",
    "add_shared_experts",
    "fused_moe",
    "pack_moe_experts",
    "select_experts",
]


@dataclass(frozen=True)
class RouterConfig:
    """How router logits become (expert, weight) pairs; see the module docstring."""

    num_experts: int
    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = False
    softmax_after_topk: bool = False  # gpt-oss: top-k of the logits, softmax over those
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    # How a group is scored: the sum of its two best experts (V3) or its best one (V2).
    group_score: Literal["top2_sum", "max"] = "top2_sum"

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in [1, {self.num_experts}]")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.softmax_after_topk and self.scoring != "softmax":
            raise ValueError("softmax_after_topk needs softmax scoring")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(
                f"num_experts ({self.num_experts}) must split into num_groups ({self.num_groups})"
            )
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_groups ({self.topk_groups}) must be in [1, num_groups]")
        if self.group_score not in ("top2_sum", "max"):
            raise ValueError(f"group_score must be 'top2_sum' or 'max', got {self.group_score!r}")
        per_group = self.num_experts // self.num_groups
        least = 2 if self.group_score == "top2_sum" else 1
        if self.num_groups > 1 and (per_group < least or self.top_k > self.topk_groups * per_group):
            raise ValueError(
                f"top_k ({self.top_k}) needs more experts than topk_groups ({self.topk_groups}) "
                f"groups of {per_group} hold (and a group scores by its best {least})"
            )


def select_experts(
    logits: torch.Tensor,  # [T, E] router logits
    cfg: RouterConfig,
    correction_bias: torch.Tensor | None = None,  # [E]: added for the choice only (sigmoid)
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [T, K] float32, ids [T, K] int64)
    """Each token's experts and their weights, in float32."""
    if logits.dim() != 2 or logits.shape[1] != cfg.num_experts:
        raise ValueError(f"logits: expected [T, {cfg.num_experts}], got {tuple(logits.shape)}")
    logits = logits.float()
    if cfg.softmax_after_topk:
        top, ids = torch.topk(logits, cfg.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    scores = torch.softmax(logits, dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_groups > 1:
        t = choice.shape[0]
        grouped = choice.view(t, cfg.num_groups, -1)
        if cfg.group_score == "max":
            group_scores = grouped.amax(dim=-1)  # [T, G]
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, cfg.topk_groups, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, -1)
    ids = torch.topk(choice, cfg.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling != 1.0:
        weights = weights * cfg.routed_scaling
    return weights, ids


def add_shared_experts(
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64
    first_shared: int,  # index of the first shared expert in the stacked weights
    num_shared: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K + S], [T, K + S])
    """Also send every token to experts ``first_shared .. first_shared + num_shared - 1``
    with weight 1 (not scaled: the routed scaling applies to routed experts only)."""
    t = topk_ids.shape[0]
    shared = torch.arange(first_shared, first_shared + num_shared, device=topk_ids.device)
    ids = torch.cat([topk_ids, shared.expand(t, num_shared)], dim=1)
    ones = torch.ones(t, num_shared, dtype=topk_weights.dtype, device=topk_weights.device)
    return torch.cat([topk_weights, ones], dim=1), ids


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64
    b13: torch.Tensor | None = None,  # [E, 2I]: each expert's gate bias, then its up bias
    b2: torch.Tensor | None = None,  # [E, H]
    activation: ClampedSwiGLU | None = None,  # None: SiLU-and-mul
    packed: PackedExperts | None = None,  # CPU: w13 / w2 prepacked (``pack_moe_experts``)
) -> torch.Tensor:  # [T, H] in x's dtype
    """``sum_k w[t, k] * (down_e(act(gate_up_e(x_t) + b13_e)) + b2_e)``, ``e = ids[t, k]``:
    each expert's GEMMs once per call over all the tokens routed to it. With ``packed``
    the GEMMs run on it and ``w13`` / ``w2`` give only their shapes and dtype."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("x must be [T, H], w13 [E, 2I, H] and w2 [E, H, I]")
    e, two_i, h = w13.shape
    if two_i % 2 or h != x.shape[1] or w2.shape != (e, h, two_i // 2):
        raise ValueError(
            f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[:1] != x.shape[:1]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
            f"must both be [T={x.shape[0]}, K]"
        )
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"expert weights ({w13.dtype}, {w2.dtype}) must be x's dtype {x.dtype}")
    for name, bias, shape in (("b13", b13, (e, two_i)), ("b2", b2, (e, h))):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype != x.dtype):
            raise ValueError(
                f"{name}: expected {list(shape)} in {x.dtype}, got {list(bias.shape)} {bias.dtype}"
            )
    if packed is not None and (
        packed.shape != tuple(w13.shape) or packed.dtype != x.dtype or x.device.type != "cpu"
    ):
        raise ValueError(
            f"packed experts {packed.shape} {packed.dtype} serve CPU input of w13's shape "
            f"{tuple(w13.shape)}; got {x.dtype} on {x.device}"
        )
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    if packed is not None:
        return fused_moe_cpu(x, w13, w2, topk_weights, topk_ids, b13, b2, activation, packed)
    args = (x, w13, w2, topk_weights, topk_ids, b13, b2, activation)
    if x.device.type == "cpu":
        return fused_moe_cpu(*args)
    if x.device.type == "cuda":
        try:
            from pdserve.kernels.triton.moe import fused_moe_triton
        except ImportError:  # triton missing: torch still works on CUDA
            return fused_moe_ref(*args)
        return fused_moe_triton(*args)
    return fused_moe_ref(*args)
