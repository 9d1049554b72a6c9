"""Dispatch of the quantized linear kernels: the module the engine gets for a quantized
weight on its device (CPU kernels from ``kernels/cpu/quant_linear.py``, Triton GEMMs from
``kernels/triton/quant_gemm.py``, imported lazily so a machine without triton runs).

The weight arrives in the layout of ``kernels/quant_reference.py`` (values [N, K], float32
scales [N, G]); the module returned holds it packed for its kernel. Nothing here keeps
state besides the modules it returns.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn

from pdserve.kernels import quant_reference as ref
from pdserve.kernels.cpu import quant_linear as cpu

Activations = Literal["int8", "fp8"] | None

__all__ = ["Activations", "is_quantized_linear", "make_quantized_linear", "weight_dtype_of"]


@functools.cache
def _cpu_weight_only(act_dtype: torch.dtype) -> bool:
    return cpu.cpu_weight_only_supported(act_dtype)


class _CudaQuantLinear(nn.Module):
    """A quantized linear on CUDA through the Triton GEMMs (inference only)."""

    def __init__(
        self,
        q: torch.Tensor,  # [N, K] int8 | float8_e4m3fn
        scale: torch.Tensor,  # [N, G] float32
        bias: torch.Tensor | None,  # [N]
        activations: Activations,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.weight = q.contiguous()
        self.scale = scale.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        # int8 x int8 needs per-channel scales; everything else dequantizes in registers.
        self.w8a8 = activations == "int8" and q.dtype == torch.int8 and scale.shape[1] == 1
        self.weight_dtype = _describe(q, scale, activations if self.w8a8 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pdserve.kernels.triton import quant_gemm

        rows = x.reshape(-1, self.in_features)
        if self.w8a8:
            xq, xs = ref.quantize_per_token_int8(rows)
            out = quant_gemm.int8_w8a8_gemm(xq, xs, self.weight, self.scale, self.bias, x.dtype)
        else:
            out = quant_gemm.dequant_gemm(rows, self.weight, self.scale, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def _describe(q: torch.Tensor, scale: torch.Tensor, activations: Activations) -> str:
    kind = "float8_e4m3" if q.dtype == ref.FP8_DTYPE else "int8"
    return f"{kind} ({'w8a8' if activations == 'int8' else 'weight-only'})"


def make_quantized_linear(
    q: torch.Tensor,  # [N, K] int8 | float8_e4m3fn
    scale: torch.Tensor,  # [N, G] float32
    bias: torch.Tensor | None,  # [N]
    activations: Activations,  # dynamic per-token activation quantization, or None
    act_dtype: torch.dtype,  # the dtype the layer's input arrives in
) -> nn.Module:
    """The fastest kernel module on ``q``'s device for this weight and activation scheme.

    fp8 activations are not quantized on a CPU (no fp8 GEMM there): the weight is
    dequantized per tile into the activations' dtype instead."""
    if q.device.type == "cuda":
        return _CudaQuantLinear(q, scale, bias, activations)
    per_channel = scale.shape[1] == 1
    if q.dtype == torch.int8 and per_channel:
        if activations == "int8":
            return cpu.Int8Linear(q, scale, bias)
        if _cpu_weight_only(act_dtype):
            return cpu.Int8WeightOnlyLinear(q, scale, bias, act_dtype)
    return cpu.DequantLinear(q, scale, bias)


def is_quantized_linear(module: nn.Module) -> bool:
    """Whether ``module`` is one of the quantized kernel modules made here."""
    return isinstance(module, (cpu._QuantLinearBase, _CudaQuantLinear))


def weight_dtype_of(model: nn.Module) -> str:
    """What the model's decoder linears hold: e.g. "int8 (w8a8)", or "bfloat16"."""
    kinds = {
        m.weight_dtype
        for m in model.modules()
        if isinstance(m, (cpu._QuantLinearBase, _CudaQuantLinear))
    }
    if kinds:
        return ", ".join(sorted(kinds))
    p = next((p for n, p in model.named_parameters() if "layers" in n), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "unknown"
