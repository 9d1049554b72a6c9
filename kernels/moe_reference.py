"""Pure-torch reference of the fused mixture-of-experts: one expert at a time, float32 math.

The oracle of ``kernels/cpu/moe.py`` and ``kernels/triton/moe.py``. It loops over experts
and gathers each one's tokens exactly as the modelling code of Mixtral / Qwen3-MoE does;
it must stay obvious rather than fast (the benchmark's per-expert baseline is transformers'
own loop, not this).

Weights are in the layout the fused kernels use: ``w13 [E, 2I, H]`` (each expert's gate
rows, then its up rows) and ``w2 [E, H, I]``, i.e. the checkpoint's per-expert
``gate_proj``/``up_proj``/``down_proj`` (``w1``/``w3``/``w2`` in Mixtral) stacked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fused_moe_ref"]


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64, each in [0, E)
) -> torch.Tensor:  # [T, H] in x's dtype
    """``sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = ids[t, k]``."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        h = x[token].float() @ w13[e].float().t()
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = act @ w2[e].float().t()
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out.to(x.dtype)
