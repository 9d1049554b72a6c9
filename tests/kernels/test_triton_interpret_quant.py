"""The Triton quantized GEMMs, run by Triton's interpreter, against their torch references."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.conftest import TRITON_IMPORTED_TOO_EARLY

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA machine: gpu_verify covers the compiled kernels", allow_module_level=True)
if TRITON_IMPORTED_TOO_EARLY:
    pytest.skip("triton was imported before TRITON_INTERPRET was set", allow_module_level=True)

from pdserve.kernels import quant_reference as R  # noqa: E402
from pdserve.kernels.triton.quant_gemm import dequant_gemm, int8_w8a8_gemm  # noqa: E402

SHAPES = [(1, 64, 48), (5, 96, 40), (20, 160, 72)]  # (M, K, N), odd tails included


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_w8a8_gemm_matches_reference(m: int, k: int, n: int, with_bias: bool):
    g = torch.Generator().manual_seed(m * k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    q, scale = R.quantize_weight(w, torch.int8)
    xq, xs = R.quantize_per_token_int8(x)
    out = int8_w8a8_gemm(xq, xs, q, scale, bias, torch.float32)
    want = R.w8a8_linear(x, q, scale, bias)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("qdtype", [torch.int8, R.FP8_DTYPE])
@pytest.mark.parametrize("group", [None, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_gemm_matches_reference(m, k, n, qdtype, group, dtype):
    g = torch.Generator().manual_seed(m + k + n)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    q, scale = R.quantize_weight(w, qdtype, group)
    out = dequant_gemm(x, q, scale, bias)
    assert out.dtype == dtype
    want = R.weight_only_linear(x, q, scale, bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * want.abs().max().item())
