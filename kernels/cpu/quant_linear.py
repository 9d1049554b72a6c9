"""CPU linear layers over int8 / float8 weights, packed once at load time.

- ``Int8Linear`` (W8A8): activations quantized to int8 per token at run time, an int8 x
  int8 GEMM with exact int32 sums, then both scales applied in float32. On a CPU with
  AMX-INT8, pdserve's AMX kernel at every row count; else up to ``NATIVE_ROWS`` rows
  (decode steps) the native AVX512-VNNI kernel (``kernels/cpu/int8_native.py``, both read
  the packed weight in one pass), more rows on oneDNN's prepacked int8 matmul
  (``torch._int_mm`` where torch lacks that op), which computes faster there.
- ``Int8WeightOnlyLinear`` (W8A16): the same two GEMMs with each activation row split into
  int8 planes (two for bf16 activations, three for float32; the error, at most
  absmax / 64516 per element with two, is far below the activations' own rounding), so an
  int8 weight runs at int8 speed. Without the native kernel: per-channel int8 weights
  widened inside ``torch.ops.aten._weight_int8pack_mm`` for a few rows (a GEMV at heart),
  the tiled dequantization below for more.
- ``DequantLinear``: any other quantized weight (float8, or int8 with group scales): a tile
  of output rows at a time is dequantized into the activations' dtype and multiplied by
  the dense path, so memory holds the quantized weight plus one small tile.

Each has a pure-torch reference in ``pdserve.kernels.quant_reference``. These modules are
inference-only and hold no trainable parameters.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import quant_reference as ref
from pdserve.kernels.cpu import int8_native

__all__ = ["DequantLinear", "Int8Linear", "Int8WeightOnlyLinear"]

_TILE_BYTES = 1 << 20  # dequantized weight bytes per tile: stays in L2 between the two passes
_GEMV_ROWS = 2  # most rows the weight-only int8 op serves before the tiled path is faster
# Most activation rows (tokens x planes) the native VNNI kernel takes before oneDNN's int8
# matmul is faster, on a CPU without AMX-INT8 (docs/quantization.md).
NATIVE_ROWS = 16


def _tiled_dequant_linear(
    rows: torch.Tensor,  # [M, K] float
    q: torch.Tensor,  # [N, K] int8 | float8_e4m3fn
    scale: torch.Tensor,  # [N, G] float32
) -> torch.Tensor:  # [M, N] rows.dtype
    """``rows @ dequant(q)^T``, a tile of output rows of the weight at a time."""
    tile_rows = max(16, _TILE_BYTES // (2 * q.shape[1]))
    parts = []
    for start in range(0, q.shape[0], tile_rows):
        stop = min(start + tile_rows, q.shape[0])
        tile = ref.dequantize_weight(q[start:stop], scale[start:stop], rows.dtype)
        parts.append(F.linear(rows, tile))
    return torch.cat(parts, dim=-1)


class _QuantLinearBase(nn.Module):
    weight_dtype: str  # what `pdserve status` and the logs report

    def __init__(
        self,
        q: torch.Tensor,  # [N, K] int8 | float8_e4m3fn
        scale: torch.Tensor,  # [N, G] float32
        bias: torch.Tensor | None,  # [N]
    ) -> None:
        super().__init__()
        if q.dim() != 2 or scale.dim() != 2 or scale.shape[0] != q.shape[0]:
            raise ValueError(
                f"{type(self).__name__}: want q [N, K] and scale [N, G], got "
                f"{tuple(q.shape)} and {tuple(scale.shape)}"
            )
        self.out_features, self.in_features = q.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features or not x.is_floating_point():
            raise ValueError(
                f"{type(self).__name__}: want float input [..., {self.in_features}], got "
                f"{x.dtype} {tuple(x.shape)}"
            )
        return x.reshape(-1, self.in_features)

    def _finish(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weights={self.weight_dtype}"
        )


def _check_per_channel_int8(name: str, q: torch.Tensor, scale: torch.Tensor) -> None:
    if q.dtype != torch.int8 or scale.shape[1] != 1:
        raise ValueError(
            f"{name}: want int8 weights with per-channel scales [N, 1], got {q.dtype} and "
            f"scales {tuple(scale.shape)}"
        )


def onednn_int8_supported() -> bool:
    """Whether torch has oneDNN's prepacked int8 linear (``torch.ops.onednn.qlinear_*``)."""
    try:
        q = torch.ones(8, 64, dtype=torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(q, None)
        onednn_int8_sums(torch.ones(1, 64, dtype=torch.int8), packed, 8)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def onednn_int8_sums(xq: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """The int32 sums ``xq @ q^T`` (as float32) of oneDNN's prepacked int8 matmul."""
    ones, zeros = torch.ones(n), torch.zeros(n, dtype=torch.int64)
    return torch.ops.onednn.qlinear_pointwise(
        xq, 1.0, 0, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [None], ""
    )


_onednn_int8 = functools.cache(onednn_int8_supported)


class _Int8PlanesLinear(_QuantLinearBase):
    """int8 activation planes x int8 weights, exact int32 sums. With AMX-INT8: the native
    AMX kernel at every row count, on the one packed weight. Without: the native VNNI
    kernel for up to ``NATIVE_ROWS`` plane rows, oneDNN's prepacked int8 matmul above
    (``torch._int_mm`` on the row-major weight where torch lacks the op), so the module
    holds the weight twice, in both kernels' layouts."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        keep_row_major: bool = False,
    ) -> None:
        super().__init__(q, scale, bias)
        _check_per_channel_int8(type(self).__name__, q, scale)
        self.scale_row = scale.float().reshape(1, -1).contiguous()  # [1, N]
        self.native = int8_native.PackedInt8.pack(q, scale) if int8_native.available() else None
        self.amx = self.native is not None and int8_native.amx_available()
        self.native_rows = NATIVE_ROWS
        onednn = not self.amx and _onednn_int8()
        self.onednn = torch.ops.onednn.qlinear_prepack(q, None) if onednn else None
        # _int_mm takes the [K, N] operand as the transposed view of the row-major weight.
        keep = keep_row_major or (self.onednn is None and not self.amx)
        self.weight = q.contiguous() if keep else None

    def _planes_linear(self, x: torch.Tensor, planes: int) -> torch.Tensor:  # x's shape, dtype
        rows = self._rows(x)
        native = self.native is not None and rows.dtype in (torch.float32, torch.bfloat16)
        if native and (self.amx or rows.shape[0] * planes <= self.native_rows):
            assert self.native is not None
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            out = int8_native.linear(rows, self.native, self.bias, planes, amx=self.amx)
            return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)
        if native:
            xq, xs = int8_native.quantize(rows.contiguous(), planes)
        elif planes == 1:  # the reference's per-token quantization
            xq, xs = ref.quantize_per_token_int8(rows)
        else:
            raise ValueError(f"{type(self).__name__}: {planes} planes need the native kernel")
        if self.onednn is not None:
            acc = onednn_int8_sums(xq, self.onednn, self.out_features)  # [M * planes, N]
        else:
            assert self.weight is not None
            acc = torch._int_mm(xq, self.weight.t()).float()
        if native:  # the scales, plane sum, bias and rounding in one pass
            assert self.native is not None
            out = int8_native.finish(acc, xs, self.native.scale, self.bias, planes, rows.dtype)
            return out.view(*x.shape[:-1], self.out_features)
        out = acc * xs * self.scale_row
        if planes > 1:
            out = out.view(rows.shape[0], planes, -1).sum(1)
        return self._finish(out, x)


class Int8Linear(_Int8PlanesLinear):
    """``y = dequant(quant_token(x) @ Wq^T)``: W8A8 with per-channel weight scales."""

    weight_dtype = "int8 (w8a8)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._planes_linear(x, 1)


class Int8WeightOnlyLinear(_Int8PlanesLinear):
    """``y = x @ (Wq * s)^T`` with per-channel int8 weights: activations in int8 planes
    through the int8 GEMMs where the native kernel runs, else widened weights."""

    weight_dtype = "int8 (weight-only)"

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        act_dtype: torch.dtype,
    ) -> None:
        # The widened-weight fallback (no native kernel) reads the row-major weight.
        native = int8_native.available() and act_dtype in (torch.float32, torch.bfloat16)
        super().__init__(q, scale, bias, keep_row_major=not native)
        self.act_dtype = act_dtype
        # Planes per activation row: bf16 has 8 significant bits, float32 24.
        self.planes = 2 if act_dtype == torch.bfloat16 else 3
        # The fallback's op takes the scales in the activations' dtype.
        self.scales = scale.reshape(-1).to(act_dtype).contiguous()  # [N]
        self.scale = scale.float().contiguous()  # [N, 1] for the tiled path
        self.gemv_rows = _GEMV_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x)
        if rows.dtype != self.act_dtype:
            raise ValueError(
                f"Int8WeightOnlyLinear: packed for {self.act_dtype} input, got {rows.dtype}"
            )
        if self.native is not None and rows.dtype in (torch.float32, torch.bfloat16):
            return self._planes_linear(x, self.planes)
        assert self.weight is not None  # kept for this path
        if rows.shape[0] > self.gemv_rows:
            return self._finish(_tiled_dequant_linear(rows, self.weight, self.scale), x)
        out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight, self.scales)
        return self._finish(out, x)


class DequantLinear(_QuantLinearBase):
    """``y = x @ dequant(Wq)^T``, dequantizing a tile of output rows at a time."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(q, scale, bias)
        self.weight = q.contiguous()
        self.scale = scale.float().contiguous()
        self.weight_dtype = "float8_e4m3" if q.dtype == ref.FP8_DTYPE else "int8 (grouped)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._finish(_tiled_dequant_linear(self._rows(x), self.weight, self.scale), x)


def cpu_weight_only_supported(act_dtype: torch.dtype) -> bool:
    """Whether ``_weight_int8pack_mm`` runs for activations of this dtype on this build."""
    try:
        x = torch.zeros(1, 64, dtype=act_dtype)
        torch.ops.aten._weight_int8pack_mm(
            x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, dtype=act_dtype)
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True
