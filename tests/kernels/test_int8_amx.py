"""The AMX-INT8 linear (``kernels/cpu/csrc/linear_int8_amx.cpp``) against the torch reference
and the VNNI kernel, and the fallback where AMX is absent."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pdserve.kernels import quant_reference as R
from pdserve.kernels.cpu import int8_native, native
from pdserve.kernels.cpu.quant_linear import Int8Linear, Int8WeightOnlyLinear

needs_amx = pytest.mark.skipif(
    not int8_native.amx_available(), reason="needs a CPU and OS with AMX-INT8 tiles"
)
ODD = [(97, 45), (200, 70), (64, 32), (130, 33)]  # (K, N): K, N off the 64 x 32 tiles


def _case(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m).unsqueeze(1)
    w = torch.randn(n, k, generator=g) * 0.1
    q, scale = R.quantize_weight(w, torch.int8)
    return x, q, scale, torch.randn(n, generator=g)


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a8_equals_the_reference_bit_for_bit_at_1_to_33_rows(dtype: torch.dtype, with_bias: bool):
    for m in range(1, 34):
        k, n = ODD[m % len(ODD)]
        x, q, scale, bias = _case(m, k, n, seed=m)
        x = x.to(dtype)
        b = bias if with_bias else None
        out = int8_native.linear(x, int8_native.PackedInt8.pack(q, scale), b, 1, amx=True)
        # Exact int32 sums, then the reference's float32 products and sum, rounded once.
        want = R.w8a8_linear(x, q, scale, b).to(dtype)
        assert torch.equal(out, want), (m, k, n, (out.float() - want.float()).abs().max())


@needs_amx
@pytest.mark.parametrize("planes", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_and_vnni_give_identical_outputs(planes: int, dtype: torch.dtype):
    # 1..33 tokens, and 40 / 256 (several row blocks, prefill sizes).
    for m in [*range(1, 34), 40, 256]:
        k, n = ODD[m % len(ODD)]
        x, q, scale, bias = _case(m, k, n, seed=100 + m)
        packed = int8_native.PackedInt8.pack(q, scale)
        x = x.to(dtype)
        b = bias if m % 2 else None
        amx = int8_native.linear(x, packed, b, planes, amx=True)
        vnni = int8_native.linear(x, packed, b, planes)
        assert torch.equal(amx, vnni), (m, k, n)


@needs_amx
def test_modules_run_amx_and_match_the_reference():
    x, q, scale, bias = _case(20, 200, 70, seed=7)
    layer = Int8Linear(q, scale, bias)
    # One packed weight serves every row count: no oneDNN copy, no row-major copy.
    assert layer.amx and layer.onednn is None and layer.weight is None
    assert torch.equal(layer(x), R.w8a8_linear(x, q, scale, bias))
    xb = x.to(torch.bfloat16)
    wo = Int8WeightOnlyLinear(q, scale, bias, torch.bfloat16)
    assert wo.amx
    want = R.weight_only_linear(xb, q, scale, bias)
    torch.testing.assert_close(wo(xb).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max())


@pytest.mark.skipif(not int8_native.available(), reason="the VNNI kernel needs AVX512-VNNI")
@pytest.mark.parametrize("m", [1, 9, 33])
def test_without_amx_the_modules_fall_back_to_vnni_and_onednn(
    m: int, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(int8_native, "amx_available", lambda: False)
    x, q, scale, bias = _case(m, 97, 45, seed=m)
    layer = Int8Linear(q, scale, bias)
    assert not layer.amx
    want = R.w8a8_linear(x, q, scale, bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_build_without_amx_reports_it_absent(tmp_path: Path):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or not int8_native.available():
        pytest.skip("needs a C++ compiler and an AVX512-VNNI CPU")
    src = Path(native.__file__).with_name("csrc") / "linear_int8_amx.cpp"
    lib = tmp_path / "no_amx.so"
    flags = [*native._FLAGS, "-mno-amx-tile", "-mno-amx-int8"]
    subprocess.run([compiler, *flags, "-o", str(lib), str(src)], check=True, timeout=120)
    assert ctypes.CDLL(str(lib)).pdserve_int8_amx_supported() == 0
