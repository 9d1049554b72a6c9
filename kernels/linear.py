"""CPU linear layers with their weights packed once at load time.

- ``PackedLinear``: a bfloat16 model on a CPU with native bf16 (AVX512-BF16 / AMX), the
  weights in oneDNN's blocked layout.
- ``Bf16WeightLinear``: a float32 model whose weights are exactly bfloat16 values (a bf16
  checkpoint served in float32 on a CPU without native bf16, AVX2 + FMA): the weights are
  held as bf16, half the bytes every decode step reads, and widened to float32 inside the
  native kernel (``kernels/csrc/linear_bf16w.cpp``). Widening is exact, so the results are
  the float32 model's up to summation order.

For ``PackedLinear``: ``F.linear`` on a CPU reorders the weight into oneDNN's blocked layout
on every call; for a decode step (a handful of rows against megabytes of weights) that
reorder is a third of the matmul. ``pack_linears`` does it once, at load time, with the ops
PyTorch's own inductor uses for weight prepacking (``mkldnn._reorder_linear_weight`` /
``mkldnn._linear_pointwise``). The results are the same oneDNN matmul, so outputs are
unchanged; only the per-call reorder goes away.

``PackedLinear`` applies only where it helps and is supported: CPU tensors, bfloat16
weights, and a CPU with native bfloat16 (AVX512-BF16 or AMX), which is also where bfloat16
is the fast dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kernels import native

__all__ = ["Bf16WeightLinear", "PackedLinear", "can_pack", "holds_bf16_values", "pack_linears"]

logger = logging.getLogger(__name__)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``pack_linears`` packs a model of this dtype on this device."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without the op
        return False


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        # No batch-size hint: the packed layout serves every batch size (decode rows and
        # prefill chunks alike) at the same speed as a per-size one in our measurements.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # no copy when already so
        out = torch.ops.mkldnn._linear_pointwise(
            rows, self.packed_weight, self.bias, "none", [], ""
        )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def holds_bf16_values(weight: torch.Tensor) -> bool:
    """Whether a float32 CPU tensor holds only bfloat16 values (rounding to bf16 loses
    nothing), as the weights of a bfloat16 checkpoint loaded in float32 do."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return False
    bits = weight.detach().contiguous().view(torch.int32)
    return not bool(torch.any(bits & 0xFFFF))


class Bf16WeightLinear(nn.Module):
    """Float32 ``y = x W^T + b`` with ``W`` held as bfloat16 in the native kernel's panel
    layout (inference only). Build it from an ``nn.Linear`` whose weight passes
    ``holds_bf16_values``; the result is then the float32 layer's."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        if not holds_bf16_values(weight):
            raise ValueError(
                "Bf16WeightLinear: the weight must be float32 on the CPU holding bfloat16 "
                f"values only, got {weight.dtype} on {weight.device}"
            )
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed_weight = native.pack_bf16_weight(weight.to(torch.bfloat16))
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Bf16WeightLinear: want float32 CPU input [..., {self.in_features}], got "
                f"{x.dtype} {tuple(x.shape)} on {x.device}"
            )
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = native.bf16_weight_linear(rows, self.packed_weight, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            "weights=bfloat16 (float32 math)"
        )


def _packed(linear: nn.Linear) -> nn.Module | None:
    weight = linear.weight
    if can_pack(weight.dtype, weight.device):
        return PackedLinear(linear)
    if native.bf16_weight_linear_available():
        try:  # its constructor checks that the weight holds bf16 values (one pass over it)
            return Bf16WeightLinear(linear)
        except ValueError:
            return None
    return None


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` (in place) by a ``PackedLinear`` where
    ``can_pack`` says so for its weight, else by a ``Bf16WeightLinear`` where its float32
    weight holds bfloat16 values and the native kernel runs; returns how many were replaced.

    The unpacked weights are dropped (a tied ``lm_head`` keeps sharing the embedding's
    tensor, which the embedding still needs), so packing does not double the memory.
    """
    kinds: dict[str, int] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (packed := _packed(child)) is not None:
                setattr(parent, name, packed)
                kinds[type(packed).__name__] = kinds.get(type(packed).__name__, 0) + 1
    for kind, count in kinds.items():
        logger.info("packed %d linear layers as %s", count, kind)
    return sum(kinds.values())
