"""The fused MoE's CPU path on experts prepacked for oneDNN (``PackedExperts``) or quantized
to int8 (``QuantizedExperts``) against the per-expert reference, and ``pack_moe_experts``
preparing a module in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.kernels import quant_reference
from pdserve.kernels.cpu.linear import can_pack
from pdserve.kernels.moe_ops import (
    PackedExperts,
    QuantizedExperts,
    fused_moe,
    pack_moe_experts,
    quantize_experts,
)
from pdserve.kernels.moe_reference import fused_moe_ref
from tests.kernels.moe_cases import assert_moe_close, make_moe_problem

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
BF16_PACKS = can_pack(torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("tokens", [1, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "bias+clamped-swiglu"])
def test_packed_experts_match_per_expert_reference(tokens, dtype, gpt_oss) -> None:
    if dtype == torch.bfloat16 and not BF16_PACKS:
        pytest.skip("no native bf16 in oneDNN on this CPU")
    # 16 experts, top-4: batch 1 leaves 12 experts without tokens, 32 skewed tokens pile
    # onto the first few.
    p = make_moe_problem(
        tokens, 64, 48, 16, 4, dtype, seed=tokens, skew=tokens == 32, gpt_oss=gpt_oss
    )
    packed = PackedExperts.pack(p.w13, p.w2)
    out = fused_moe(*p.args(), **p.extras(), packed=packed)
    assert_moe_close(out, fused_moe_ref(*p.args(), **p.extras()), dtype)
    # The unpacked path is the same oneDNN math in bf16 and a like GEMM in float32.
    unpacked = fused_moe(*p.args(), **p.extras())
    torch.testing.assert_close(out, unpacked, atol=1e-5 if dtype == torch.float32 else 0, rtol=0)


def test_packed_experts_skip_experts_without_tokens() -> None:
    p = make_moe_problem(3, 32, 16, 8, 2, torch.float32, seed=5)
    unused = sorted(set(range(8)) - set(p.topk_ids.flatten().tolist()))
    assert unused, "the case must leave an expert without tokens"
    w13, w2 = p.w13.clone(), p.w2.clone()
    w13[unused], w2[unused] = float("nan"), float("nan")
    out = fused_moe(*p.args(), packed=PackedExperts.pack(w13, w2))
    assert torch.isfinite(out).all()
    assert_moe_close(out, fused_moe_ref(*p.args()), torch.float32)


def test_packed_experts_refuse_what_they_do_not_fit() -> None:
    p = make_moe_problem(3, 32, 16, 4, 2, torch.float32, seed=0)
    other = make_moe_problem(3, 32, 8, 4, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="packed experts"):
        fused_moe(*p.args(), packed=PackedExperts.pack(other.w13, other.w2))
    with pytest.raises(ValueError, match="packed experts"):
        fused_moe(*p.args(), packed=PackedExperts.pack(p.w13.bfloat16(), p.w2.bfloat16()))
    with pytest.raises(ValueError, match="PackedExperts"):
        PackedExperts.pack(p.w13.half(), p.w2.half())
    with pytest.raises(ValueError, match="PackedExperts"):
        PackedExperts.pack(p.w13, p.w2[:, :, :4])


class _Experts(nn.Module):
    """What a model's MoE block declares for ``pack_moe_experts``."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w13 = nn.Parameter(w13.clone(), requires_grad=False)
        self.w2 = nn.Parameter(w2.clone(), requires_grad=False)
        self.packed_experts: PackedExperts | None = None

    def forward(self, x, weights, ids):  # type: ignore[no-untyped-def]
        return fused_moe(x, self.w13, self.w2, weights, ids, packed=self.packed_experts)


@pytest.mark.skipif(not BF16_PACKS, reason="no native bf16 in oneDNN on this CPU")
def test_pack_moe_experts_packs_bf16_blocks_in_place_and_frees_the_stacked_weights() -> None:
    p = make_moe_problem(8, 64, 32, 8, 2, torch.bfloat16, seed=2)
    model = nn.Sequential(_Experts(p.w13, p.w2), _Experts(p.w13.float(), p.w2.float()))
    want = model[0](p.x, p.topk_weights, p.topk_ids)
    assert pack_moe_experts(model) == 1  # float32 stays on torch's matmul (docs/models.md)
    block = model[0]
    assert block.packed_experts is not None and model[1].packed_experts is None
    assert block.w13.is_meta and block.w2.is_meta  # the unpacked copy is gone
    assert block.w13.shape == p.w13.shape and block.w13.dtype == torch.bfloat16
    torch.testing.assert_close(block(p.x, p.topk_weights, p.topk_ids), want, atol=0, rtol=0)
    assert pack_moe_experts(model) == 0  # packing twice does nothing


def _dequantized(w: torch.Tensor) -> torch.Tensor:
    """The stacked weights as per-channel int8 rounds them."""
    out = []
    for j in range(w.shape[0]):
        q, scale = quant_reference.quantize_weight(w[j], torch.int8)
        out.append(quant_reference.dequantize_weight(q, scale, w.dtype))
    return torch.stack(out)


# Relative to the largest output, against the reference on the int8-rounded weights: W8A8
# also rounds every activation row to int8 (twice: into gate/up and into down).
INT8_TOL = {"w8a8": 3e-2, "weight-only": 1e-4}


@pytest.mark.parametrize("tokens", [1, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("int8", ["w8a8", "weight-only"])
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "bias+clamped-swiglu"])
def test_int8_experts_match_the_reference_on_their_rounded_weights(
    tokens, dtype, int8, gpt_oss
) -> None:
    p = make_moe_problem(
        tokens, 64, 48, 16, 4, dtype, seed=tokens, skew=tokens == 32, gpt_oss=gpt_oss
    )
    experts = quantize_experts(p.w13, p.w2, int8)
    out = fused_moe(*p.args(), **p.extras(), packed=experts)
    want = fused_moe_ref(
        p.x, _dequantized(p.w13), _dequantized(p.w2), p.topk_weights, p.topk_ids, **p.extras()
    )
    assert out.dtype == dtype and out.shape == want.shape
    err = (out.float() - want.float()).abs().max().item() / want.float().abs().max().item()
    tol = max(INT8_TOL[int8], 2e-2 if dtype == torch.bfloat16 else 0.0)
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def test_pack_moe_experts_quantizes_under_at_load_int8_and_packs_under_fp8() -> None:
    p = make_moe_problem(8, 64, 32, 8, 2, torch.float32, seed=4)
    model = _Experts(p.w13, p.w2)
    assert pack_moe_experts(model, "int8") == 1
    assert isinstance(model.packed_experts, QuantizedExperts) and model.w13.is_meta
    want = fused_moe(*p.args(), packed=quantize_experts(p.w13, p.w2, "w8a8"))
    torch.testing.assert_close(model(p.x, p.topk_weights, p.topk_ids), want, atol=0, rtol=0)
    # fp8 at load leaves the experts float: float32 ones stay stacked.
    assert pack_moe_experts(_Experts(p.w13, p.w2), "fp8") == 0
