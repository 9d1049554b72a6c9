"""CPU linear layers over int8 / float8 weights, packed once at load time.

- ``Int8Linear`` (W8A8): activations quantized to int8 per token at run time, an int8 x
  int8 GEMM with int32 sums (``torch._int_mm``: oneDNN, AVX512-VNNI / AMX-INT8), then both
  scales applied in float32.
- ``Int8WeightOnlyLinear`` (W8A16): activations as they are, per-channel int8 weights
  widened inside the GEMM (``torch.ops.aten._weight_int8pack_mm``) for a few rows; that op
  is a GEMV at heart, so larger batches take the tiled dequantization below.
- ``DequantLinear``: any other quantized weight (float8, or int8 with group scales): a tile
  of output rows at a time is dequantized into the activations' dtype and multiplied by
  the dense path, so memory holds the quantized weight plus one small tile.

Each has a pure-torch reference in ``pdserve.kernels.quant_reference``. These modules are
inference-only and hold no trainable parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import quant_reference as ref

__all__ = ["DequantLinear", "Int8Linear", "Int8WeightOnlyLinear"]

_TILE_BYTES = 1 << 20  # dequantized weight bytes per tile: stays in L2 between the two passes
_GEMV_ROWS = 2  # most rows the weight-only int8 op serves before the tiled path is faster


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


class Int8Linear(_QuantLinearBase):
    """``y = dequant(quant_token(x) @ Wq^T)``: W8A8 with per-channel weight scales."""

    weight_dtype = "int8 (w8a8)"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(q, scale, bias)
        if q.dtype != torch.int8 or scale.shape[1] != 1:
            raise ValueError(
                f"Int8Linear: want int8 weights with per-channel scales [N, 1], got {q.dtype} "
                f"and scales {tuple(scale.shape)}"
            )
        # oneDNN takes the [K, N] operand as the transposed view of the row-major weight
        # without a copy per call.
        self.weight = q.contiguous()
        self.scale_row = scale.float().reshape(1, -1).contiguous()  # [1, N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x)
        xq, xs = ref.quantize_per_token_int8(rows)
        acc = torch._int_mm(xq, self.weight.t())  # [M, N] int32
        return self._finish(acc.float() * xs * self.scale_row, x)


class Int8WeightOnlyLinear(_QuantLinearBase):
    """``y = x @ (Wq * s)^T`` with per-channel int8 weights widened inside the GEMM."""

    weight_dtype = "int8 (weight-only)"

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        act_dtype: torch.dtype,
    ) -> None:
        super().__init__(q, scale, bias)
        if q.dtype != torch.int8 or scale.shape[1] != 1:
            raise ValueError(
                f"Int8WeightOnlyLinear: want int8 weights with per-channel scales [N, 1], got "
                f"{q.dtype} and scales {tuple(scale.shape)}"
            )
        self.weight = q.contiguous()
        # The op takes the scales in the activations' dtype.
        self.act_dtype = act_dtype
        self.scales = scale.reshape(-1).to(act_dtype).contiguous()  # [N]
        self.scale = scale.float().contiguous()  # [N, 1] for the tiled path
        self.gemv_rows = _GEMV_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x)
        if rows.dtype != self.act_dtype:
            raise ValueError(
                f"Int8WeightOnlyLinear: packed for {self.act_dtype} input, got {rows.dtype}"
            )
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
