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

Other code (Gemma's ``1 + weight`` norm, MoE experts, projections wrapped for tensor
parallelism) keeps transformers' modules.
"""

from __future__ import annotations

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
    gate, up = mlp.gate_proj, mlp.up_proj
    weight = torch.cat([gate.weight.detach(), up.weight.detach()])
    bias = None
    if gate.bias is not None:
        bias = torch.cat([gate.bias.detach(), up.bias.detach()])
    gate_up = nn.Linear(
        gate.in_features, weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype
    )
    gate_up.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        gate_up.bias = nn.Parameter(bias, requires_grad=False)
    return FusedMLP(gate_up, mlp.down_proj, mlp.act_fn)


def _is_plain_pair(a: Any, b: Any) -> bool:
    return (
        type(a) is nn.Linear
        and type(b) is nn.Linear
        and a.in_features == b.in_features
        and a.out_features == b.out_features
        and (a.bias is None) == (b.bias is None)
        and a.weight.dtype == b.weight.dtype
        and a.weight.device == b.weight.device
    )


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def fuse_modules(model: nn.Module) -> int:
    """Swap every Llama-style RMSNorm and MLP module of ``model`` for its fused
    equivalent (in place, before the linears are packed); returns how many were swapped."""
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    swaps: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        forward = type(module).forward
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
    return len(swaps)
