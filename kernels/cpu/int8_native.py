"""ctypes wrappers of the native int8-weight linear (``kernels/cpu/csrc/linear_int8.cpp``).

``PackedInt8`` is an [N, K] int8 weight with per-channel scales in the kernel's layout (input
quads for VPDPBUSD, each output's weight sum beside). ``linear`` splits each activation row
into ``planes`` int8 planes (1: per-token W8A8; 2-3: what the weight-only linears use, an
error far below a bf16 activation's rounding) and multiplies them with exact int32 sums;
``linear(..., amx=True)`` runs the same product on AMX tiles
(``kernels/cpu/csrc/linear_int8_amx.cpp``, identical results) where ``amx_available()``;
``quantize`` gives the planes alone for a GEMM elsewhere (oneDNN) and ``finish`` turns its
sums into the output in one pass. The modules in
``kernels/cpu/quant_linear.py`` own the weights and check arguments.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kernels.cpu import native

__all__ = [
    "MAX_PLANES",
    "PackedInt8",
    "amx_available",
    "available",
    "finish",
    "linear",
    "quantize",
]

MAX_PLANES = 3
_I64, _P = ctypes.c_int64, ctypes.c_void_p
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_configured: ctypes.CDLL | None = None  # the library, its int8 functions typed
_AMX_LINEAR: dict[torch.dtype, Any] = {}  # activation dtype -> the AMX entry point


def _lib() -> ctypes.CDLL:
    global _configured
    if _configured is not None:
        return _configured
    lib = native.library()
    if lib is None or not lib.pdserve_linear_int8_supported():
        raise RuntimeError("the native int8 linear is unavailable on this machine")
    for fn, args in {
        "pdserve_int8_packed_bytes": [_I64, _I64],
        "pdserve_int8_wsum_len": [_I64],
        "pdserve_int8_row_bytes": [_I64],
        "pdserve_int8_amx_row_bytes": [_I64],
    }.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = _I64
    lib.pdserve_pack_int8.argtypes = [_P, _I64, _I64, _I64, _P, _P]
    lib.pdserve_pack_int8.restype = None
    for dtype, suffix in _SUFFIX.items():
        fn = getattr(lib, f"pdserve_linear_int8_{suffix}")
        fn.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, _I64, _P, _P, _P]
        fn.restype = None
        fn = getattr(lib, f"pdserve_linear_int8_amx_{suffix}")
        fn.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _P, _P]
        fn.restype = None
        _AMX_LINEAR[dtype] = fn
        fn = getattr(lib, f"pdserve_int8_quantize_{suffix}")
        fn.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _I64, _P]
        fn.restype = None
        fn = getattr(lib, f"pdserve_int8_finish_{suffix}")
        fn.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _I64]
        fn.restype = None
    _configured = lib
    return lib


def available() -> bool:
    """Whether the library loaded and was built for a CPU with AVX512-VNNI."""
    lib = native.library()
    return lib is not None and bool(lib.pdserve_linear_int8_supported())


def amx_available() -> bool:
    """Whether the AMX-INT8 kernel runs here: built for a CPU with AMX tiles and int8, and
    the OS granted this process the tile state."""
    lib = native.library()
    return available() and lib is not None and bool(lib.pdserve_int8_amx_supported())


@dataclass(frozen=True)
class PackedInt8:
    """An int8 weight with per-channel scales in the native kernel's layout."""

    packed: torch.Tensor  # flat int8
    wsum: torch.Tensor  # int32: each output's weight sum (zero-padded)
    scale: torch.Tensor  # [N] float32
    out_features: int
    in_features: int
    amx_row_bytes: int  # bytes of one activation plane row for the AMX kernel

    @classmethod
    def pack(cls, q: torch.Tensor, scale: torch.Tensor) -> PackedInt8:  # [N, K] int8, [N, 1]
        lib = _lib()
        n, k = q.shape
        q = q.contiguous()
        packed = torch.empty(lib.pdserve_int8_packed_bytes(n, k), dtype=torch.int8)
        wsum = torch.empty(lib.pdserve_int8_wsum_len(n), dtype=torch.int32)
        lib.pdserve_pack_int8(q.data_ptr(), k, n, k, packed.data_ptr(), wsum.data_ptr())
        row_bytes = lib.pdserve_int8_amx_row_bytes(k)
        return cls(packed, wsum, scale.float().reshape(-1).contiguous(), n, k, row_bytes)


def linear(
    rows: torch.Tensor,  # [M, K] float32 | bfloat16, last dim contiguous
    w: PackedInt8,
    bias: torch.Tensor | None,  # [N] float32, contiguous
    planes: int,
    amx: bool = False,
) -> torch.Tensor:  # [M, N] rows.dtype
    """``rows`` in ``planes`` int8 planes times ``w`` (exact int32 sums), both scales and the
    bias in float32, rounded once to ``rows.dtype``; on AMX tiles if ``amx`` (the caller
    checks ``amx_available()``), else on VNNI."""
    lib = _lib()
    m, k = rows.shape
    n = w.out_features
    out = torch.empty((m, n), dtype=rows.dtype)
    if m and amx:
        # One scratch buffer: the planes' bytes, then (64-byte aligned) their scales.
        xq_bytes = (m * planes * w.amx_row_bytes + 63) // 64 * 64
        scratch = torch.empty(xq_bytes + 4 * m * planes, dtype=torch.uint8)
        _AMX_LINEAR[rows.dtype](
            rows.data_ptr(), rows.stride(0), m, k, planes, w.packed.data_ptr(), n,
            w.scale.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), out.stride(0), scratch.data_ptr(), scratch.data_ptr() + xq_bytes,
        )  # fmt: skip
    elif m:
        xq = torch.empty(m * planes * lib.pdserve_int8_row_bytes(k), dtype=torch.uint8)
        xs = torch.empty(m * planes, dtype=torch.float32)
        sums = torch.empty(m * planes * n, dtype=torch.float32)
        getattr(lib, f"pdserve_linear_int8_{_SUFFIX[rows.dtype]}")(
            rows.data_ptr(), rows.stride(0), m, k, planes, w.packed.data_ptr(), n,
            w.wsum.data_ptr(), w.scale.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), out.stride(0), xq.data_ptr(), xs.data_ptr(), sums.data_ptr(),
        )  # fmt: skip
    return out


def quantize(
    rows: torch.Tensor,  # [M, K] float32 | bfloat16, last dim contiguous
    planes: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [M * planes, K] int8, [M * planes, 1] float32
    """The int8 planes of every row (row r's planes at r * planes ..) and their scales."""
    lib = _lib()
    m, k = rows.shape
    xq = torch.empty((m * planes, k), dtype=torch.int8)
    xs = torch.empty((m * planes, 1), dtype=torch.float32)
    if m:
        getattr(lib, f"pdserve_int8_quantize_{_SUFFIX[rows.dtype]}")(
            rows.data_ptr(), rows.stride(0), m, k, planes, xq.data_ptr(), k, xs.data_ptr()
        )
    return xq, xs


def finish(
    acc: torch.Tensor,  # [M * planes, N] float32: int32 sums of the planes, contiguous
    xs: torch.Tensor,  # [M * planes, 1] float32: the planes' scales (from ``quantize``)
    scale: torch.Tensor,  # [N] float32: the weight's per-channel scales, contiguous
    bias: torch.Tensor | None,  # [N] float32, contiguous
    planes: int,
    dtype: torch.dtype,  # float32 | bfloat16
) -> torch.Tensor:  # [M, N] dtype
    """``sum_p (acc_p * xs_p) * scale + bias`` per row, rounded once to ``dtype``."""
    lib = _lib()
    rows, n = acc.shape[0] // planes, acc.shape[1]
    out = torch.empty((rows, n), dtype=dtype)
    if rows:
        getattr(lib, f"pdserve_int8_finish_{_SUFFIX[dtype]}")(
            acc.data_ptr(), rows, n, planes, xs.data_ptr(), scale.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
        )  # fmt: skip
    return out
