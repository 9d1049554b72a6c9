"""Pure-torch reference of the fused mixture-of-experts: one expert at a time, float32 math.

The oracle of ``kernels/cpu/moe.py`` and ``kernels/triton/moe.py``. It loops over experts
and gathers each one's tokens exactly as the modelling code of Mixtral / Qwen3-MoE does;
it must stay obvious rather than fast (the benchmark's per-expert baseline is transformers'
own loop, not this).

Weights are in the layout the fused kernels use: ``w13 [E, 2I, H]`` (each expert's gate
rows, then its up rows) and ``w2 [E, H, I]``, i.e. the checkpoint's per-expert
``gate_proj``/``up_proj``/``down_proj`` (``w1``/``w3``/``w2`` in Mixtral) stacked.
Optional per-expert biases (``b13 [E, 2I]``, ``b2 [E, H]``) and the activation between the
two GEMMs: SiLU-and-mul, or gpt-oss's ``ClampedSwiGLU``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ClampedSwiGLU", "fused_moe_ref", "moe_activation_ref"]


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
    with ``g = min(gate, limit)``."""

    alpha: float = 1.702
    limit: float = 7.0


def moe_activation_ref(
    h: torch.Tensor,  # [R, 2I]: gate columns, then up columns
    activation: ClampedSwiGLU | None,  # None: SiLU-and-mul
) -> torch.Tensor:  # [R, I] float32
    gate, up = h.float().chunk(2, dim=-1)
    if activation is None:
        return F.silu(gate) * up
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(-activation.limit, activation.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64, each in [0, E)
    b13: torch.Tensor | None = None,  # [E, 2I]
    b2: torch.Tensor | None = None,  # [E, H]
    activation: ClampedSwiGLU | None = None,  # None: SiLU-and-mul
) -> torch.Tensor:  # [T, H] in x's dtype
    """``sum_k w[t, k] * down_e(act(gate_up_e(x_t)))`` with ``e = ids[t, k]``."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        h = x[token].float() @ w13[e].float().t()
        if b13 is not None:
            h = h + b13[e].float()
        y = moe_activation_ref(h, activation) @ w2[e].float().t()
        if b2 is not None:
            y = y + b2[e].float()
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out.to(x.dtype)
