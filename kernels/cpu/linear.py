"""CPU linear layers with their weights packed once at load time.

- ``Bf16Linear``: a bfloat16 model on a CPU with AVX512-BF16 but no AMX, the weights in
  the native kernel's layout (``kernels/cpu/csrc/linear_bf16.cpp``): at decode sizes it reads
  the weights faster than oneDNN's packed matmul, and it is on par with oneDNN from 32 rows
  up to prefill sizes (measurements in docs/cpu.md).
- ``PackedLinear``: a bfloat16 model on a CPU with AMX (or without the native kernel), the
  weights in oneDNN's blocked layout.
- ``Bf16WeightLinear``: a float32 model whose weights are exactly bfloat16 values (a bf16
  checkpoint served in float32 on a CPU without native bf16, AVX2 + FMA): the weights are
  held as bf16, half the bytes every decode step reads, and widened to float32 inside the
  native kernel (``kernels/cpu/csrc/linear_bf16w.cpp``). Widening is exact, so the results are
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

import functools
import logging
from pathlib import Path

import torch
from torch import nn

from pdserve.kernels.cpu import native

__all__ = [
    "Bf16Linear",
    "Bf16WeightLinear",
    "PackedLinear",
    "can_pack",
    "holds_bf16_values",
    "pack_linears",
    "packed_linear_float32",
]

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


@functools.cache
def _has_amx() -> bool:
    """Whether the CPU has AMX bf16 tiles (Intel Sapphire Rapids on), where oneDNN wins."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any("amx_bf16" in ln.split() for ln in text.splitlines() if ln.startswith("flags"))


class _NativeLinear(nn.Module):
    """A linear layer run by a native kernel (``kernels/cpu/native.py``) on a packed weight."""

    input_dtype: torch.dtype  # what the kernel takes and returns
    kind: str  # for repr

    def __init__(self, linear: nn.Linear, packed_weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed_weight = packed_weight
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def _run(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.input_dtype or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__}: want {str(self.input_dtype).removeprefix('torch.')} "
                f"CPU input [..., {self.in_features}], got {x.dtype} {tuple(x.shape)} on "
                f"{x.device}"
            )
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return self._run(rows).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class Bf16Linear(_NativeLinear):
    """bfloat16 ``y = x W^T + b`` (float32 sums, rounded once) with ``W`` in the native
    AVX512-BF16 kernel's layout (inference only)."""

    input_dtype = torch.bfloat16
    kind = "packed=AVX512-BF16"

    def __init__(self, linear: nn.Linear) -> None:
        weight = linear.weight.detach()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(
                f"Bf16Linear: the weight must be bfloat16 on the CPU, got {weight.dtype} on "
                f"{weight.device}"
            )
        super().__init__(linear, native.pack_bf16_linear_weight(weight))

    def _run(self, rows: torch.Tensor) -> torch.Tensor:
        return native.bf16_linear(rows, self.packed_weight, self.out_features, self.bias)


def holds_bf16_values(weight: torch.Tensor) -> bool:
    """Whether a float32 CPU tensor holds only bfloat16 values (rounding to bf16 loses
    nothing), as the weights of a bfloat16 checkpoint loaded in float32 do."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return False
    bits = weight.detach().contiguous().view(torch.int32)
    return not bool(torch.any(bits & 0xFFFF))


class Bf16WeightLinear(_NativeLinear):
    """Float32 ``y = x W^T + b`` with ``W`` held as bfloat16 in the native kernel's panel
    layout (inference only). Build it from an ``nn.Linear`` whose weight passes
    ``holds_bf16_values``; the result is then the float32 layer's."""

    input_dtype = torch.float32
    kind = "weights=bfloat16 (float32 math)"

    def __init__(self, linear: nn.Linear) -> None:
        weight = linear.weight.detach()
        if not holds_bf16_values(weight):
            raise ValueError(
                "Bf16WeightLinear: the weight must be float32 on the CPU holding bfloat16 "
                f"values only, got {weight.dtype} on {weight.device}"
            )
        super().__init__(linear, native.pack_bf16_weight(weight.to(torch.bfloat16)))

    def _run(self, rows: torch.Tensor) -> torch.Tensor:
        return native.bf16_weight_linear(rows, self.packed_weight, self.out_features, self.bias)


def packed_linear_float32(x: torch.Tensor, layer: nn.Module) -> torch.Tensor | None:
    """``layer(x)`` in float32 (float32 ``x`` [M, K], float32 sums and result) for a layer
    ``pack_linears`` made; None for any other layer."""
    if isinstance(layer, Bf16Linear):
        rows = x.reshape(-1, layer.in_features)  # made contiguous as it is rounded to bf16
        return native.bf16_linear_float32(rows, layer.packed_weight, layer.out_features, layer.bias)
    if isinstance(layer, Bf16WeightLinear):
        return layer(x)
    if isinstance(layer, PackedLinear):
        # oneDNN's packed matmul returns its input's dtype; pack_linears leaves a logits
        # projection unpacked where it would make one of these.
        raise TypeError("PackedLinear has no float32 result; keep this layer unpacked")
    return None


def _packed(linear: nn.Linear, float32_result: bool) -> nn.Module | None:
    weight = linear.weight
    if can_pack(weight.dtype, weight.device):
        # The logits take the native kernel on AMX CPUs too: oneDNN's packed matmul would
        # round them to bf16, and widening the weight every step cost 10-30x the kernel
        # (docs/quantization.md).
        if native.bf16_linear_available() and (float32_result or not _has_amx()):
            return Bf16Linear(linear)
        if float32_result:
            return None  # oneDNN's packed matmul would round the result to bf16
        return PackedLinear(linear)
    if native.bf16_weight_linear_available():
        try:  # its constructor checks that the weight holds bf16 values (one pass over it)
            return Bf16WeightLinear(linear)
        except ValueError:
            return None
    return None


def pack_linears(model: nn.Module, float32_results: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every ``nn.Linear`` in ``model`` (in place) where ``can_pack`` says so for its
    weight by a ``Bf16Linear`` (AVX512-BF16 without AMX) or a ``PackedLinear`` (oneDNN),
    else by a ``Bf16WeightLinear`` where its float32 weight holds bfloat16 values and the
    native kernel runs; returns how many were replaced.

    The unpacked weights are dropped (a tied ``lm_head`` keeps sharing the embedding's
    tensor, which the embedding still needs), so packing does not double the memory.
    Layers named in ``float32_results`` are run through ``packed_linear_float32`` (the
    logits): they are packed only into a kind that can give a float32 result.
    """
    kinds: dict[str, int] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if (packed := _packed(child, name in float32_results)) is not None:
                setattr(parent, name, packed)
                kinds[type(packed).__name__] = kinds.get(type(packed).__name__, 0) + 1
    for kind, count in kinds.items():
        logger.info("packed %d linear layers as %s", count, kind)
    return sum(kinds.values())
