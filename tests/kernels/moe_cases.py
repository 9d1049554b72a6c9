"""Random fused-MoE problems (fixed seeds) for the CPU, interpreter and GPU checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.moe_reference import ClampedSwiGLU

# Max abs error against the float32 reference relative to the output's largest value: bf16
# rounds the gate/up output and the activation (8 mantissa bits each).
MOE_REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class MoEProblem:
    x: torch.Tensor  # [T, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    topk_weights: torch.Tensor  # [T, K] float32
    topk_ids: torch.Tensor  # [T, K] int64
    b13: torch.Tensor | None = None  # [E, 2I]
    b2: torch.Tensor | None = None  # [E, H]
    activation: ClampedSwiGLU | None = None

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.w13, self.w2, self.topk_weights, self.topk_ids

    def extras(self) -> dict[str, object]:
        """The biases and activation, as keyword arguments of every fused-MoE entry point."""
        return {"b13": self.b13, "b2": self.b2, "activation": self.activation}


def make_moe_problem(
    tokens: int,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype,
    seed: int,
    device: str = "cpu",
    skew: bool = False,
    gpt_oss: bool = False,
) -> MoEProblem:
    """Distinct experts per token; ``skew`` routes most tokens to the first few experts
    (blocks that span many rows next to experts with none); ``gpt_oss`` adds expert biases
    and the clamped SwiGLU, with gate/up outputs large enough that the clamps bite."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g)
    if skew:
        logits[:, : top_k + 1] += 4.0
    topk_ids = torch.topk(logits, top_k, dim=-1)[1]
    topk_weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    b13 = b2 = activation = None
    if gpt_oss:
        w13 = w13 * 6.0
        b13 = torch.randn(experts, 2 * inter, generator=g).to(device, dtype)
        b2 = torch.randn(experts, hidden, generator=g).to(device, dtype)
        activation = ClampedSwiGLU()
    return MoEProblem(
        x.to(device, dtype),
        w13.to(device, dtype),
        w2.to(device, dtype),
        topk_weights.to(device),
        topk_ids.to(device),
        b13,
        b2,
        activation,
    )


def assert_moe_close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == want.dtype and out.shape == want.shape
    scale = max(want.float().abs().max().item(), 1e-6)
    err = (out.float() - want.float()).abs().max().item() / scale
    assert err <= MOE_REL_TOL[dtype], f"relative error {err:.2e} > {MOE_REL_TOL[dtype]:.0e}"
