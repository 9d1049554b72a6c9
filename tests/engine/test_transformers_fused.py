"""The transformers path's fused RMSNorm, MLP and q/k/v projections give transformers' own
outputs."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig
from transformers.models.gemma2.modeling_gemma2 import Gemma2Model
from transformers.models.llama.modeling_llama import LlamaModel

from pdserve.engine.models.transformers_fused import FusedMLP, FusedRMSNorm, fuse_modules


def _llama(dtype: torch.dtype, mlp_bias: bool = False) -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mlp_bias=mlp_bias,
        attention_bias=mlp_bias,
    )  # fmt: skip
    model = LlamaModel(config).to(dtype).eval()
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_()
    return model


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_fused_llama_hidden_states_equal_transformers_bf16(mlp_bias: bool) -> None:
    reference = _llama(torch.bfloat16, mlp_bias)
    fused = copy.deepcopy(reference)
    # two norms a layer, the final norm, the MLPs and the attentions
    assert fuse_modules(fused) == 2 * 2 + 1 + 2 + 2
    assert isinstance(fused.norm, FusedRMSNorm)
    assert isinstance(fused.layers[0].mlp, FusedMLP)
    attn = fused.layers[0].self_attn
    assert not hasattr(attn, "q_proj") and attn.qkv_proj.out_features == 64 + 2 * 32
    ids = torch.randint(0, 97, (1, 23))
    with torch.no_grad():
        want = reference(ids).last_hidden_state
        got = fused(ids).last_hidden_state
    assert torch.equal(got, want)


def test_fused_llama_float32_matches_transformers() -> None:
    reference = _llama(torch.float32)
    fused = copy.deepcopy(reference)
    fuse_modules(fused)
    ids = torch.randint(0, 97, (1, 23))
    with torch.no_grad():
        torch.testing.assert_close(
            fused(ids).last_hidden_state, reference(ids).last_hidden_state, rtol=1e-5, atol=1e-5
        )


def test_other_norm_code_is_left_alone() -> None:
    config = Gemma2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model = Gemma2Model(config).eval()
    norm_types = {type(m) for m in model.modules() if "RMSNorm" in type(m).__name__}
    fuse_modules(model)
    assert {type(m) for m in model.modules() if "RMSNorm" in type(m).__name__} == norm_types
    assert not any(isinstance(m, FusedRMSNorm) for m in model.modules())
