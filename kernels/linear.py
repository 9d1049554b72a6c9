"""Linear layers with weights pre-packed for oneDNN on CPUs with native bfloat16.

``F.linear`` on a CPU reorders the weight into oneDNN's blocked layout on every call; for a
decode step (a handful of rows against megabytes of weights) that reorder is a third of the
matmul. ``pack_linears`` does it once, at load time, for every ``nn.Linear`` of a bfloat16
model, with the ops PyTorch's own inductor uses for weight prepacking
(``mkldnn._reorder_linear_weight`` / ``mkldnn._linear_pointwise``). The results are the same
oneDNN matmul, so outputs are unchanged; only the per-call reorder goes away.

Applies only where it helps and is supported: CPU tensors, bfloat16 weights, and a CPU with
native bfloat16 (AVX512-BF16 or AMX), which is also where bfloat16 is the fast dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

__all__ = ["PackedLinear", "can_pack", "pack_linears"]

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


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a ``PackedLinear`` (in place) when
    ``can_pack`` says so for its weight; returns how many were replaced.

    The unpacked weights are dropped (a tied ``lm_head`` keeps sharing the embedding's
    tensor, which the embedding still needs), so packing does not double the memory.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and can_pack(child.weight.dtype, child.weight.device):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    if replaced:
        logger.info("packed %d linear layers for oneDNN", replaced)
    return replaced
