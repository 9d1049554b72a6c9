"""Fewer, larger ops for the transformers path's Llama-style modules, same results.

A decode step of one sequence is dominated by per-op overhead. transformers' RMSNorm is six
small ops (cast, square, mean, rsqrt, multiply, cast) plus the weight multiply, twice a
layer, and its MLP runs the gate and up projections as two matmuls over the same input.
Modules whose ``forward`` is the same code as ``LlamaRMSNorm.forward`` / ``LlamaMLP.forward``
(transformers copies them into every architecture that shares them: Mistral, Qwen2/3,
Mixtral's norms, OLMo 2, Granite, ...) are swapped, in place, for:

- ``FusedRMSNorm``: pdserve's one-pass RMSNorm kernel with a unit weight returns the float32
  normalised value rounded once to the input's dtype (transformers'
  ``hidden_states.to(input_dtype)``); the module's own weight then multiplies it in the
  model's dtype, as transformers does.
- ``FusedMLP``: one matmul over the concatenated gate and up weights (each output column is
  the same dot product), then the module's own activation and ``down_proj``, as in
  transformers.
- Attention modules whose ``forward`` is ``LlamaAttention.forward``'s code (compared
  unwrapped: transformers' ``deprecate_kwarg`` wraps every attention forward alike) keep
  their module and get one ``qkv_proj`` matmul over the concatenated q/k/v weights; the
  rest of the forward is transformers' (its rotary, cache and attention-interface calls,
  looked up in the module's own globals).

Other code (Gemma's ``1 + weight`` norm, MoE experts, projections wrapped for tensor
parallelism) keeps transformers' modules.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn

from pdserve.kernels import ops


def _same_code(a: Any, b: Any) -> bool:
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if ca is None or cb is None:
        return False
    return bool(
        ca.co_code == cb.co_code and ca.co_consts == cb.co_consts and ca.co_names == cb.co_names
    )


class FusedRMSNorm(nn.Module):
    """``weight * rms_normalise(x).to(x.dtype)`` with the normalisation in one kernel call;
    holds the replaced module's own weight parameter."""

    unit: torch.Tensor

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps
        self.register_buffer("unit", torch.ones_like(weight.detach()), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        rows = hidden_states.reshape(-1, shape[-1]).contiguous()
        normed = ops.rms_norm(rows, self.unit, self.variance_epsilon)
        assert isinstance(normed, torch.Tensor)
        return self.weight * normed.view(shape)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class FusedMLP(nn.Module):
    """``down_proj(act_fn(gate) * up)`` with gate and up from one matmul."""

    def __init__(self, gate_up_proj: nn.Linear, down_proj: nn.Module, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.intermediate = gate_up_proj.out_features // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        out: torch.Tensor = self.down_proj(self.act_fn(gate) * up)
        return out


def _fused_mlp(mlp: Any) -> FusedMLP:  # a LlamaMLP-like module
    return FusedMLP(_concat_linear([mlp.gate_proj, mlp.up_proj]), mlp.down_proj, mlp.act_fn)


def _is_plain_pair(a: Any, b: Any, same_out: bool = True) -> bool:
    return (
        type(a) is nn.Linear
        and type(b) is nn.Linear
        and a.in_features == b.in_features
        and (a.out_features == b.out_features or not same_out)
        and (a.bias is None) == (b.bias is None)
        and a.weight.dtype == b.weight.dtype
        and a.weight.device == b.weight.device
    )


def _concat_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the parts' outputs side by side."""
    weight = torch.cat([p.weight.detach() for p in parts])
    bias = None
    if parts[0].bias is not None:
        bias = torch.cat([p.bias.detach() for p in parts])
    # The weights' shapes, not the modules' in/out_features: under tensor parallelism
    # transformers shards the weights and leaves the features as the whole model's.
    fused = nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias is not None, device="meta",
        dtype=weight.dtype,
    )  # fmt: skip
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def _fused_attention_forward(
    self: Any,  # a LlamaAttention-like module, its q/k/v projections fused by _fuse_qkv
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """``LlamaAttention.forward`` with q, k and v from one matmul."""
    g = _forward_globals(type(self))
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
    query_states = q.view(hidden_shape).transpose(1, 2)
    key_states = k.view(hidden_shape).transpose(1, 2)
    value_states = v.view(hidden_shape).transpose(1, 2)
    assert position_embeddings is not None
    cos, sin = position_embeddings
    query_states, key_states = g["apply_rotary_pos_emb"](query_states, key_states, cos, sin)
    if cache is not None:
        key_states, value_states = cache.update(
            key_states, value_states, self.layer_idx, kwargs=kwargs
        )
    attention_interface = g["ALL_ATTENTION_FUNCTIONS"].get_interface(
        self.config._attn_implementation, g["eager_attention_forward"]
    )
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
        **kwargs,
    )  # fmt: skip
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


_FORWARD_GLOBALS: dict[type[nn.Module], dict[str, Any]] = {}


def _forward_globals(cls: type[nn.Module]) -> dict[str, Any]:
    """The namespace of the modelling module that defines ``cls.forward``."""
    namespace = _FORWARD_GLOBALS.get(cls)
    if namespace is None:
        namespace = _FORWARD_GLOBALS[cls] = inspect.unwrap(cls.forward).__globals__
    return namespace


def _fuse_qkv(attn: Any) -> None:  # a LlamaAttention-like module, changed in place
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    attn.qkv_proj = _concat_linear(parts)
    attn.qkv_sizes = [p.weight.shape[0] for p in parts]
    del attn.q_proj, attn.k_proj, attn.v_proj
    attn.forward = types.MethodType(_fused_attention_forward, attn)


def _is_llama_attention(module: nn.Module, llama_forward: Any) -> bool:
    forward = inspect.unwrap(type(module).forward)
    if not _same_code(forward, inspect.unwrap(llama_forward)):
        return False
    q, k, v = (getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj"))
    return _is_plain_pair(q, k, same_out=False) and _is_plain_pair(q, v, same_out=False)


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def fuse_modules(model: nn.Module) -> int:
    """Swap every Llama-style RMSNorm and MLP module of ``model`` for its fused
    equivalent and fuse every Llama-style attention's q/k/v projections (in place, before
    the linears are packed); returns how many modules were swapped or fused."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    swaps: list[tuple[str, nn.Module]] = []
    attentions: list[nn.Module] = []
    for name, module in model.named_modules():
        forward = type(module).forward
        if _is_llama_attention(module, LlamaAttention.forward):
            attentions.append(module)
            continue
        if (
            _same_code(forward, LlamaRMSNorm.forward)
            and isinstance(getattr(module, "weight", None), nn.Parameter)
            and isinstance(getattr(module, "variance_epsilon", None), float)
        ):
            swaps.append((name, FusedRMSNorm(module.weight, module.variance_epsilon)))
        elif _same_code(forward, LlamaMLP.forward) and _is_plain_pair(
            getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
        ):
            swaps.append((name, _fused_mlp(module)))
    for name, new in swaps:
        _swap(model, name, new)
    for attn in attentions:
        _fuse_qkv(attn)
    return len(swaps) + len(attentions)
