"""The fused MoE's CPU path against the per-expert reference, and the router against the
routers of transformers' own Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3 and DeepSeek-V2
modelling code."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.moe_ops import (
    ClampedSwiGLU,
    RouterConfig,
    add_shared_experts,
    fused_moe,
    select_experts,
)
from pdserve.kernels.moe_reference import fused_moe_ref
from tests.kernels.moe_cases import assert_moe_close, make_moe_problem

# (tokens, hidden, intermediate, experts, top_k): decode-sized to prefill-sized, odd sizes,
# more experts than tokens and the reverse, top-1 and all experts.
SHAPES = [(1, 64, 32, 8, 2), (7, 48, 40, 16, 4), (33, 64, 24, 4, 4), (130, 32, 16, 64, 8)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("skew", [False, True])
def test_cpu_fused_moe_matches_per_expert_reference(shape, dtype, skew) -> None:
    t, h, i, e, k = shape
    p = make_moe_problem(t, h, i, e, k, dtype, seed=sum(shape), skew=skew)
    assert_moe_close(fused_moe(*p.args()), fused_moe_ref(*p.args()), dtype)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_fused_moe_with_biases_and_clamped_swiglu_matches_reference(shape, dtype) -> None:
    t, h, i, e, k = shape
    p = make_moe_problem(t, h, i, e, k, dtype, seed=sum(shape), gpt_oss=True)
    assert_moe_close(
        fused_moe(*p.args(), **p.extras()), fused_moe_ref(*p.args(), **p.extras()), dtype
    )


def test_fused_moe_ignores_experts_without_tokens_and_handles_empty_batches() -> None:
    p = make_moe_problem(5, 32, 16, 8, 2, torch.float32, seed=3)
    w13, w2 = p.w13.clone(), p.w2.clone()
    unused = sorted(set(range(8)) - set(p.topk_ids.flatten().tolist()))
    assert unused, "the case must leave an expert without tokens"
    w13[unused], w2[unused] = float("nan"), float("nan")
    out = fused_moe(p.x, w13, w2, p.topk_weights, p.topk_ids)
    assert torch.isfinite(out).all()
    assert_moe_close(out, fused_moe_ref(*p.args()), torch.float32)
    empty = fused_moe(p.x[:0], p.w13, p.w2, p.topk_weights[:0], p.topk_ids[:0])
    assert empty.shape == (0, 32)


def test_fused_moe_refuses_mismatched_shapes() -> None:
    p = make_moe_problem(3, 32, 16, 4, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(p.x, p.w13, p.w2[:, :, :8], p.topk_weights, p.topk_ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(p.x, p.w13, p.w2, p.topk_weights[:, :1], p.topk_ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(p.x, p.w13.bfloat16(), p.w2, p.topk_weights, p.topk_ids)
    with pytest.raises(ValueError, match="b13"):
        fused_moe(*p.args(), b13=torch.zeros(p.w13.shape[0], 3))


def _hf_router(name: str, experts: int, top_k: int, **extra):  # type: ignore[no-untyped-def]
    import transformers as tf

    if name == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as cls

        config = tf.MixtralConfig(num_local_experts=experts, num_experts_per_tok=top_k, **extra)
    elif name == "qwen3-moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as cls

        config = tf.Qwen3MoeConfig(num_experts=experts, num_experts_per_tok=top_k, **extra)
    elif name == "gpt-oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter as cls

        config = tf.GptOssConfig(num_local_experts=experts, num_experts_per_tok=top_k, **extra)
    elif name == "deepseek-v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2TopkRouter as cls,
        )

        config = tf.DeepseekV2Config(n_routed_experts=experts, num_experts_per_tok=top_k, **extra)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as cls,
        )

        config = tf.DeepseekV3Config(n_routed_experts=experts, num_experts_per_tok=top_k, **extra)
    config.hidden_size = 32
    router = cls(config)
    g = torch.Generator().manual_seed(experts + top_k)
    with torch.no_grad():
        for param in router.parameters():
            param.copy_(torch.randn(param.shape, generator=g))
        for buf in router.buffers():
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.3)
    return router


# (name, experts, top_k, transformers config overrides, our RouterConfig overrides)
ROUTERS = [
    ("mixtral", 8, 2, {}, {"renormalize": True}),
    ("qwen3-moe", 16, 4, {"norm_topk_prob": False}, {}),
    ("qwen3-moe", 16, 4, {"norm_topk_prob": True}, {"renormalize": True}),
    ("gpt-oss", 8, 4, {}, {"softmax_after_topk": True}),
    (
        "deepseek-v3",
        32,
        8,
        {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True},
        {
            "scoring": "sigmoid",
            "num_groups": 4,
            "topk_groups": 2,
            "routed_scaling": 2.5,
            "renormalize": True,
        },
    ),  # fmt: skip
    (
        "deepseek-v3",
        16,
        3,
        {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False},
        {"scoring": "sigmoid"},
    ),
    (
        "deepseek-v2",
        32,
        6,
        {
            "topk_method": "group_limited_greedy",
            "n_group": 8,
            "topk_group": 3,
            "routed_scaling_factor": 2.5,
        },
        {"num_groups": 8, "topk_groups": 3, "group_score": "max", "routed_scaling": 2.5},
    ),
    (
        "deepseek-v2",
        16,
        4,
        {
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 1,
            "routed_scaling_factor": 1.5,
        },
        {"num_groups": 4, "topk_groups": 1, "group_score": "max", "routed_scaling": 1.5},
    ),
    ("deepseek-v2", 16, 3, {"routed_scaling_factor": 1.5}, {"routed_scaling": 1.5}),
]


@pytest.mark.parametrize("case", ROUTERS, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-{len(c[3])}")
def test_router_matches_transformers(case) -> None:
    name, experts, top_k, hf_extra, ours = case
    router = _hf_router(name, experts, top_k, **hf_extra)
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    cfg = RouterConfig(num_experts=experts, top_k=top_k, **ours)
    bias = getattr(router, "e_score_correction_bias", None)
    weights, ids = select_experts(logits, cfg, bias)
    # Order within a token's k experts is free (transformers' DeepSeek top-k is unsorted).
    hf_order, our_order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, our_order))
    torch.testing.assert_close(
        weights.gather(1, our_order), hf_weights.float().gather(1, hf_order), rtol=1e-6, atol=1e-6
    )


def test_router_config_refuses_impossible_choices() -> None:
    with pytest.raises(ValueError, match="top_k"):
        RouterConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="num_groups"):
        RouterConfig(num_experts=6, top_k=2, scoring="sigmoid", num_groups=4)
    with pytest.raises(ValueError, match="topk_groups"):
        RouterConfig(num_experts=8, top_k=2, num_groups=4, topk_groups=5)
    with pytest.raises(ValueError, match="softmax"):
        RouterConfig(num_experts=8, top_k=2, scoring="sigmoid", softmax_after_topk=True)
    with pytest.raises(ValueError, match="group_score"):
        RouterConfig(num_experts=8, top_k=2, num_groups=4, group_score="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="best 2"):  # V3 scores a group by its best two
        RouterConfig(num_experts=8, top_k=2, num_groups=8, topk_groups=2)
    RouterConfig(num_experts=8, top_k=2, num_groups=8, topk_groups=2, group_score="max")
    with pytest.raises(ValueError, match="logits"):
        select_experts(torch.zeros(3, 5), RouterConfig(num_experts=4, top_k=2))


# version -> (config overrides, our RouterConfig)
MOE_BLOCKS = {
    "v3": (
        {"n_group": 4, "topk_group": 2, "norm_topk_prob": True},
        RouterConfig(16, 4, "sigmoid", True, False, 4, 2, 2.5),
    ),
    "v2-group-limited": (
        {"n_group": 4, "topk_group": 2, "topk_method": "group_limited_greedy"},
        RouterConfig(16, 4, num_groups=4, topk_groups=2, routed_scaling=2.5, group_score="max"),
    ),
}


@pytest.mark.parametrize("version", list(MOE_BLOCKS))
def test_deepseek_moe_block_with_shared_experts_matches_transformers(version: str) -> None:
    """DeepSeek routing (V3: sigmoid, grouped, bias, renormalised; V2: softmax,
    group-limited, not renormalised), routed scaling and two shared experts folded into the
    one fused call give transformers' DeepseekV3MoE / DeepseekV2Moe output."""
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    extra, cfg = MOE_BLOCKS[version]
    config_cls, block_cls = (
        (tf.DeepseekV3Config, DeepseekV3MoE)
        if version == "v3"
        else (tf.DeepseekV2Config, DeepseekV2Moe)
    )
    config = config_cls(
        hidden_size=32,
        moe_intermediate_size=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        routed_scaling_factor=2.5,
        n_shared_experts=2,
        **extra,
    )
    block = block_cls(config).eval()
    g = torch.Generator().manual_seed(11)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
        if bias is not None:
            bias.copy_(torch.randn(16, generator=g) * 0.1)
    x = torch.randn(1, 20, 32, generator=g)
    with torch.no_grad():
        want = block(x)[0]
    shared = block.shared_experts
    inter = config.moe_intermediate_size
    # The shared MLP (2 x 16 columns) as two experts of 16 columns.
    sg, su = shared.gate_proj.weight.view(2, inter, 32), shared.up_proj.weight.view(2, inter, 32)
    w13 = torch.cat([block.experts.gate_up_proj, torch.cat([sg, su], dim=1)]).detach()
    sd = shared.down_proj.weight.view(32, 2, inter).permute(1, 0, 2)
    w2 = torch.cat([block.experts.down_proj, sd]).detach()
    rows = x[0]
    weights, ids = select_experts(rows @ block.gate.weight.t(), cfg, bias)
    weights, ids = add_shared_experts(weights, ids, first_shared=16, num_shared=2)
    torch.testing.assert_close(fused_moe(rows, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-5)


def test_gpt_oss_experts_match_transformers() -> None:
    """gpt-oss's experts (interleaved gate/up columns, biases, clamped SwiGLU) de-interleaved
    into the fused layout give transformers' GptOssMLP output, clamps biting."""
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = tf.GptOssConfig(
        hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=3
    )
    block = GptOssMLP(config).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=g))
    x = torch.randn(1, 20, 32, generator=g)
    with torch.no_grad():
        want = block(x)[0][0]
    experts = block.experts
    gate_up = experts.gate_up_proj.detach()  # [E, H, 2I], gate and up columns alternating
    w13 = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
    bias = experts.gate_up_proj_bias.detach()
    b13 = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=-1)
    w2 = experts.down_proj.detach().transpose(1, 2)
    rows = x[0]
    logits = rows @ block.router.weight.t() + block.router.bias
    weights, ids = select_experts(logits.detach(), RouterConfig(8, 3, softmax_after_topk=True))
    act = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
    got = fused_moe(rows, w13.contiguous(), w2.contiguous(), weights, ids, b13,
                    experts.down_proj_bias.detach(), act)  # fmt: skip
    assert (rows @ w13[0].t()).abs().max() > config.swiglu_limit  # the clamp is exercised
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
