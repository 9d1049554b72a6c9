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
keeps state. On a CPU the stacked experts are prepared once after loading
(``pack_moe_experts``): packed for oneDNN in bf16, or quantized to int8 under at-load int8
quantization (``quantize_experts``); ``fused_moe`` then runs on those (``packed=``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from pdserve.kernels import quant_reference
from pdserve.kernels.cpu.linear import can_pack
from pdserve.kernels.cpu.moe import PackedExperts, QuantizedExperts, fused_moe_cpu
from pdserve.kernels.moe_reference import ClampedSwiGLU, fused_moe_ref
from pdserve.kernels.quant_ops import Activations, make_quantized_linear

__all__ = [
    "ClampedSwiGLU",
    "PackedExperts",
    "PreparedExperts",
    "QuantizedExperts",
    "RouterConfig",
    "add_shared_experts",
    "fused_moe",
    "pack_moe_experts",
    "quantize_experts",
    "select_experts",
]

logger = logging.getLogger(__name__)

Int8Experts = Literal["w8a8", "weight-only"]
PreparedExperts = PackedExperts | QuantizedExperts  # what pack_moe_experts leaves a block
# The engine's at-load quantization -> how the experts are quantized (fp8: left float).
_AT_LOAD_INT8: dict[str, Int8Experts] = {"int8": "w8a8", "int8-weight-only": "weight-only"}


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
    # CPU: w13 / w2 prepacked or quantized to int8 (``pack_moe_experts``)
    packed: PreparedExperts | None = None,
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


def quantize_experts(
    w13: torch.Tensor,  # [E, 2I, H] float, CPU
    w2: torch.Tensor,  # [E, H, I]
    int8: Int8Experts,  # W8A8 (activations quantized per token) or int8 weights only
) -> QuantizedExperts:
    """Each expert's weights quantized to int8 per output channel (round to nearest,
    absmax scales, as at-load quantization does for the dense linears) into the CPU's
    int8 kernel modules; their input is ``w13``'s dtype."""
    if w13.device.type != "cpu":
        raise ValueError(f"quantize_experts: CPU weights only, got {w13.device}")
    activations: Activations = "int8" if int8 == "w8a8" else None

    def modules(w: torch.Tensor) -> tuple[nn.Module, ...]:
        out = []
        for j in range(w.shape[0]):
            q, scale = quant_reference.quantize_weight(w[j].detach(), torch.int8)
            out.append(make_quantized_linear(q, scale, None, activations, w.dtype))
        return tuple(out)

    e, two_i, h = w13.shape
    return QuantizedExperts(modules(w13), modules(w2), (e, two_i, h), w13.dtype)


def pack_moe_experts(model: nn.Module, quantization: str | None = None) -> int:
    """Prepare the stacked experts of every module of ``model`` that declares a
    ``packed_experts`` attribute (None) next to its ``w13`` / ``w2`` parameters, on the
    CPU: quantized to int8 (``quantize_experts``) when ``quantization`` (the engine's
    at-load method) is ``int8`` (W8A8) or ``int8-weight-only``, else packed for oneDNN
    where ``can_pack`` says so for their dtype. Returns how many were.

    The module then holds the ``PackedExperts`` / ``QuantizedExperts`` and passes it to
    ``fused_moe``; its ``w13`` / ``w2`` become meta-device parameters of the same shape and
    dtype (the shapes stay readable, the float copy is freed, and a read of its values
    fails loudly)."""
    int8 = _AT_LOAD_INT8.get(quantization or "")
    count = 0
    for module in model.modules():
        if vars(module).get("packed_experts", "absent") is not None:  # not one, or done
            continue
        w13, w2 = getattr(module, "w13", None), getattr(module, "w2", None)
        if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)):
            continue
        if w13.device.type != "cpu":
            continue
        packed: PreparedExperts
        if int8 is not None:
            packed = quantize_experts(w13, w2, int8)
        elif can_pack(w13.dtype, w13.device):
            packed = PackedExperts.pack(w13, w2)
        else:
            continue
        setattr(module, "packed_experts", packed)  # noqa: B010
        for name, param in (("w13", w13), ("w2", w2)):
            ghost = torch.empty(param.shape, dtype=param.dtype, device="meta")
            setattr(module, name, nn.Parameter(ghost, requires_grad=False))
        count += 1
    if count:
        kind = f"int8 ({int8})" if int8 else "oneDNN-packed"
        logger.info("prepared the experts of %d MoE layers as %s", count, kind)
    return count
