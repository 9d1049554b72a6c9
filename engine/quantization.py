"""Quantized linear layers: which scheme a checkpoint (or the at-load setting) asks for,
the layer the model builds for it, and how checkpoint tensors fill that layer.

Two checkpoint formats, read from ``config.json``'s ``quantization_config``:
- ``quant_method: fp8``: float8 (e4m3) weights with a per-tensor, per-channel or block
  (``weight_block_size``) scale (``weight_scale`` / ``weight_scale_inv``, both multiply),
  dynamic activation scales;
- ``quant_method: compressed-tensors``: int or float 8-bit weights (strategy tensor,
  channel, group or block; ``int-quantized``, ``float-quantized`` or ``pack-quantized``),
  symmetric, with dynamic per-token activations (W8A8) or none (weight-only).

Every scale is brought to one layout at load, float32 [N, G] per output row
(``pdserve.kernels.quant_reference``), so fusing q/k/v and sharding rows or columns for
tensor parallelism treat scales like the weight rows they belong to. This module never
picks a kernel itself: ``kernels.quant_ops`` does, after the weights are loaded.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from pdserve.kernels.ops import Activations, make_quantized_linear
from pdserve.kernels.ops import quant_reference as ref

AtLoadMethod = Literal["int8", "int8-weight-only", "fp8"]
SUPPORTED_METHODS = ("fp8", "compressed-tensors")
# Checkpoint tensor kinds that belong to a quantized linear besides weight and bias.
QUANT_KINDS = ("weight_scale", "weight_scale_inv", "weight_packed", "weight_shape",
               "weight_zero_point", "input_scale")  # fmt: skip


@dataclass(frozen=True)
class QuantScheme:
    """How the decoder's linear layers are quantized."""

    weight_dtype: Literal["int8", "fp8"]
    activations: Activations  # dynamic per-token quantization of the input, or None
    group_size: int | None = None  # input columns per scale; None = one per row
    block: tuple[int, int] | None = None  # checkpoint scales per (rows, cols) block
    packed_int32: bool = False  # compressed-tensors pack-quantized: 4 int8 per int32
    ignore: tuple[str, ...] = ("lm_head",)  # module names (or "re:" patterns) left float

    @property
    def qdtype(self) -> torch.dtype:
        return torch.int8 if self.weight_dtype == "int8" else ref.FP8_DTYPE

    def num_groups(self, in_features: int) -> int:
        """Scale groups per row in the common layout, all of one width. A block that the
        input width cuts short is held as groups of ``gcd(block, in_features)`` columns
        (200 columns in 128-blocks: 25 groups of 8), so every group lies in one block."""
        if self.block is not None:
            return in_features // math.gcd(self.block[1], in_features)
        return 1 if self.group_size is None else -(-in_features // self.group_size)

    def quantizes(self, module_name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return False
            elif module_name == pattern or module_name.endswith("." + pattern):
                return False
        return True

    def describe(self) -> str:
        acts = f"a8 {self.activations}" if self.activations else "weight-only"
        return f"{self.weight_dtype} {acts}"


def at_load_scheme(method: AtLoadMethod) -> QuantScheme:
    """The scheme ``EngineConfig.quantization`` names (per-channel weights)."""
    if method == "int8":
        return QuantScheme("int8", "int8")
    if method == "int8-weight-only":
        return QuantScheme("int8", None)
    if method == "fp8":
        return QuantScheme("fp8", "fp8")
    raise ValueError(f"quantization must be int8, int8-weight-only or fp8; got {method!r}")


def read_quantization_config(hf_config: dict[str, Any]) -> QuantScheme | None:
    """The scheme of a checkpoint's ``quantization_config``; None when it has none."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_scheme(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    if method == "mxfp4":
        raise ValueError(
            "quantization_config.quant_method 'mxfp4' is read only for gpt-oss's experts on "
            "the native path (model_impl auto or native; engine/expert_quant.py); here "
            f"supported: {', '.join(SUPPORTED_METHODS)}"
        )
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_METHODS)}"
    )


def _fp8_scheme(qc: dict[str, Any]) -> QuantScheme:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"fp8 activation_scheme {qc.get('activation_scheme')!r} is not supported; "
            "supported: dynamic"
        )
    block = qc.get("weight_block_size")
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    return QuantScheme(
        "fp8",
        "fp8",
        block=(int(block[0]), int(block[1])) if block else None,
        ignore=("lm_head", *ignore),
    )


def _compressed_tensors_scheme(qc: dict[str, Any]) -> QuantScheme:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(
            f"compressed-tensors: exactly one config group is supported, got {len(groups)}"
        )
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    fmt = groups[0].get("format") or qc.get("format")
    if weights.get("num_bits") != 8 or not weights.get("symmetric", True):
        raise ValueError(
            "compressed-tensors: only symmetric 8-bit weights are supported, got "
            f"num_bits={weights.get('num_bits')} symmetric={weights.get('symmetric')}"
        )
    wtype: Literal["int8", "fp8"] = "int8" if weights.get("type", "int") == "int" else "fp8"
    strategy = weights.get("strategy")
    group = block = None
    if strategy == "group":
        group = int(weights["group_size"])
    elif strategy == "block":
        b = weights["block_structure"]
        block = (int(b[0]), int(b[1]))
    elif strategy not in ("channel", "tensor"):
        raise ValueError(f"compressed-tensors: weight strategy {strategy!r} is not supported")
    activations: Activations = None
    if acts:
        if not acts.get("dynamic") or acts.get("num_bits") != 8:
            raise ValueError("compressed-tensors: only dynamic 8-bit activations are supported")
        activations = "int8" if acts.get("type", "int") == "int" else "fp8"
    if fmt not in ("int-quantized", "float-quantized", "pack-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors: format {fmt!r} is not supported")
    return QuantScheme(
        wtype,
        activations,
        group_size=group,
        block=block,
        packed_int32=fmt == "pack-quantized",
        ignore=tuple(qc.get("ignore") or ("lm_head",)),
    )


class QuantLinear(nn.Module):
    """A linear layer's checkpoint tensors in the common layout, until ``pack_quantized``
    swaps it for a kernel module. ``weight`` [N, K] int8/float8, ``weight_scale`` [N, G]
    float32; both keep their dtype when the model is cast to its dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: QuantScheme):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=scheme.qdtype), requires_grad=False
        )
        groups = scheme.num_groups(in_features)
        self.weight_scale = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def _apply(self, fn: Any, recurse: bool = True) -> QuantLinear:
        super()._apply(fn, recurse)
        # Device moves apply; dtype casts do not reach the quantized tensors.
        for name, dtype in (("weight", self.scheme.qdtype), ("weight_scale", torch.float32)):
            p = getattr(self, name)
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("QuantLinear runs only after pack_quantized() replaced it")


def make_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    scheme: QuantScheme | None,
    checkpoint_names: tuple[str, ...],
) -> nn.Module:
    """The linear layer the model builds: a ``QuantLinear`` for a quantized checkpoint's
    layer, else ``nn.Linear``. ``checkpoint_names`` are the modules fused into it, which
    the checkpoint must quantize all or none of."""
    if scheme is not None:
        quantized = {scheme.quantizes(n) for n in checkpoint_names}
        if len(quantized) > 1:
            raise ValueError(
                f"quantization_config quantizes some of {', '.join(checkpoint_names)} but "
                "not all; they share one fused matmul"
            )
        if quantized.pop():
            return QuantLinear(in_features, out_features, bias, scheme)
    return nn.Linear(in_features, out_features, bias)


def read_quant_tensor(
    kind: str,
    source: Any,  # a tensor or a lazy safetensors slice
    rows: slice,  # source rows this rank's destination takes
    cols: slice,  # source columns (row-parallel layers under tensor parallelism)
    dest: torch.Tensor,  # the destination rows
    scheme: QuantScheme,
    name: str,
    in_features: int | None = None,  # the layer's (this rank's) input width
) -> torch.Tensor | None:
    """A quantized layer's checkpoint tensor in the common layout, ready to copy into
    ``dest``; None for tensors that carry nothing the kernels need. Block scales need
    ``in_features`` when the width may cut the last block short."""
    if kind in ("weight_shape", "input_scale"):
        return None  # the shape is the module's; activations are quantized dynamically
    if kind == "weight_zero_point":
        if bool(_read_all(source).any()):
            raise ValueError(f"{name}: asymmetric weights (non-zero zero points) are not supported")
        return None
    if kind == "weight_packed":
        packed = torch.as_tensor(source[rows])  # [n, K / 4] int32
        return _unpack_int8(packed)[:, cols][:, : dest.shape[1]]
    if kind in ("weight_scale", "weight_scale_inv"):
        scale = _read_all(source).float()
        return _scale_rows(scale, rows, cols, dest, scheme, name, in_features)
    raise ValueError(f"checkpoint tensor {name!r}: unknown kind {kind!r}")


def _read_all(source: Any) -> torch.Tensor:
    """The whole of a tensor or lazy slice (a 0-d one included)."""
    if isinstance(source, torch.Tensor):
        return source
    return source[...] if not source.get_shape() else source[:]


def _unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors pack-quantized 8-bit values: four offset bytes per int32,
    lowest first."""
    as_bytes = packed.contiguous().view(torch.uint8).view(packed.shape[0], -1)
    return (as_bytes.to(torch.int16) - 128).to(torch.int8)


def _scale_rows(
    scale: torch.Tensor, rows: slice, cols: slice, dest: torch.Tensor, scheme: QuantScheme,
    name: str, in_features: int | None,
) -> torch.Tensor:  # fmt: skip
    n_dest, g_dest = dest.shape
    # Block columns -> equal groups (QuantScheme.num_groups): each block's scale repeated
    # over the groups it holds; the last block's extra copies fall off at g_dest.
    per_block, blocks = 1, g_dest
    if scheme.block is not None and in_features is not None:
        per_block = scheme.block[1] // math.gcd(scheme.block[1], in_features)
        blocks = -(-in_features // scheme.block[1])
    if scale.numel() == 1:  # per tensor: the same scale on every row
        return scale.reshape(1, 1).expand(n_dest, g_dest)
    if scale.dim() == 1:
        scale = scale[:, None]
    if scheme.block is not None:  # one row per block of rows: repeat it over the block
        scale = scale.repeat_interleave(scheme.block[0], dim=0)
    start = rows.start or 0
    scale = scale[start : start + n_dest]
    if cols != slice(None) and scale.shape[1] > 1:
        width = scheme.block[1] if scheme.block else scheme.group_size
        assert width is not None
        if (cols.start or 0) % width:
            raise ValueError(
                f"{name}: this rank's columns start at {cols.start}, inside a scale group "
                f"of {width}; choose a tensor_parallel_size that splits on group boundaries"
            )
        scale = scale[:, (cols.start or 0) // width :][:, :blocks]
    if per_block > 1:
        scale = scale.repeat_interleave(per_block, dim=1)[:, :g_dest]
    if tuple(scale.shape) != (n_dest, g_dest):
        raise ValueError(
            f"checkpoint tensor {name!r}: scales reshape to {tuple(scale.shape)}, expected "
            f"{(n_dest, g_dest)}"
        )
    return scale


def pack_quantized(model: nn.Module, act_dtype: torch.dtype) -> int:
    """Replace every loaded ``QuantLinear`` (in place) by its kernel module; returns how
    many were replaced."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                bias = None if child.bias is None else child.bias.detach()
                layer = make_quantized_linear(
                    child.weight.detach(), child.weight_scale.detach(), bias,
                    child.scheme.activations, act_dtype,
                )  # fmt: skip
                setattr(parent, name, layer)
                count += 1
    return count


def quantize_logits(model: nn.Module) -> None:
    """``model.lm_head`` (a float ``nn.Linear``, tied or not) -> int8 weights per output
    channel, weight-only on float32 activations (``ops.linear_float32`` runs it)."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear:
        raise ValueError(f"quantize_lm_head: want a float nn.Linear lm_head, got {type(head)}")
    q, scale = ref.quantize_weight(head.weight.detach().float(), torch.int8)
    bias = None if head.bias is None else head.bias.detach()
    model.lm_head = make_quantized_linear(q, scale, bias, None, torch.float32)


def quantize_linears(model: nn.Module, scheme: QuantScheme, act_dtype: torch.dtype) -> int:
    """Quantize every float ``nn.Linear`` the scheme covers (in place, per output channel)
    into its kernel module; the logits projection stays float. Returns how many."""
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not nn.Linear or not scheme.quantizes(full):
                continue
            q, scale = ref.quantize_weight(child.weight.detach(), scheme.qdtype)
            bias = None if child.bias is None else child.bias.detach()
            layer = make_quantized_linear(q, scale, bias, scheme.activations, act_dtype)
            setattr(parent, name, layer)
            count += 1
    return count
