"""The quantized linear kernels against their torch references (``kernels/quant_reference``).

CPU kernels here; the Triton GEMMs in ``test_triton_interpret_quant.py``.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import quant_reference as R
from pdserve.kernels.cpu import int8_native
from pdserve.kernels.cpu.quant_linear import (
    DequantLinear,
    Int8Linear,
    Int8WeightOnlyLinear,
    cpu_weight_only_supported,
)

SHAPES = [(1, 64, 32), (7, 96, 40), (33, 256, 384)]  # (M, K, N): decode, odd, prefill-ish
needs_native = pytest.mark.skipif(
    not int8_native.available(), reason="the native int8 kernel needs AVX512-VNNI"
)
# Which GEMM an int8-planes module runs: AMX (where the CPU has it), else its VNNI kernel up
# to this many plane rows, oneDNN above.
PATHS = {"native": 1 << 30, "onednn": 0}


def _pick_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "amx" and not int8_native.amx_available():
        pytest.skip("needs a CPU and OS with AMX-INT8 tiles")
    if path != "amx":
        monkeypatch.setattr(int8_native, "amx_available", lambda: False)
    if path == "torch":  # what a CPU without the native kernel runs
        monkeypatch.setattr(int8_native, "available", lambda: False)


def _case(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, k, generator=g),
        torch.randn(n, k, generator=g) * 0.1,
        torch.randn(n, generator=g),
    )


@pytest.mark.parametrize("qdtype", [torch.int8, R.FP8_DTYPE])
@pytest.mark.parametrize("group", [None, 32])
def test_quantize_weight_round_trips_within_one_step(qdtype: torch.dtype, group: int | None):
    _, w, _ = _case(1, 96, 40)
    q, scale = R.quantize_weight(w, qdtype, group)
    assert q.dtype == qdtype and scale.shape == (40, 1 if group is None else 3)
    err = (R.dequantize_weight(q, scale) - w).abs()
    step = R.expand_scale(scale, 96)
    # int8 rounds to the nearest step; e4m3 keeps 3 mantissa bits (relative 1/16).
    bound = 0.5 * step if qdtype == torch.int8 else w.abs() / 16 + step
    assert bool((err <= bound + 1e-7).all())


@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, (5, 97, 45)])  # last: K, N off the tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", [*sorted(PATHS), "amx", "torch"])
def test_int8_w8a8_matches_reference(
    m: int, k: int, n: int, dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch
):
    x, w, bias = _case(m, k, n)
    q, scale = R.quantize_weight(w, torch.int8)
    x = x.to(dtype)
    _pick_path(path, monkeypatch)
    layer = Int8Linear(q, scale, bias)
    layer.native_rows = PATHS.get(path, 0)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (m, n)
    want = R.w8a8_linear(x, q, scale, bias)
    # int32 sums are exact; only the final rounding to the output dtype differs.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, (9, 4096, 300), (5, 97, 45)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", [*sorted(PATHS), "amx", "torch"])
def test_int8_weight_only_matches_reference(
    m: int, k: int, n: int, dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch
):
    if not cpu_weight_only_supported(dtype):
        pytest.skip(f"_weight_int8pack_mm does not run {dtype} on this torch build")
    x, w, bias = _case(m, k, n)
    q, scale = R.quantize_weight(w, torch.int8)
    x = x.to(dtype)
    _pick_path(path, monkeypatch)  # torch: the widened-weight ops
    layer = Int8WeightOnlyLinear(q, scale, bias, dtype)
    layer.native_rows = PATHS.get(path, 0)
    out = layer(x)
    want = R.weight_only_linear(x, q, scale, bias)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, (3, 4096, 300)])  # last: several tiles
@pytest.mark.parametrize("qdtype", [torch.int8, R.FP8_DTYPE])
@pytest.mark.parametrize("group", [None, 32])
def test_dequant_linear_matches_reference(m: int, k: int, n: int, qdtype, group):
    x, w, bias = _case(m, k, n, seed=1)
    q, scale = R.quantize_weight(w, qdtype, group)
    out = DequantLinear(q, scale, bias)(x)
    want = R.weight_only_linear(x, q, scale, bias)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_planes_reconstruct_the_activations(dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 200, generator=g) * torch.logspace(-3, 2, 6).unsqueeze(1)).to(dtype)
    x[2] = 0  # an all-zero row keeps a finite scale
    # One plane is the reference's per-token quantization, bit for bit.
    q1, s1 = int8_native.quantize(x, 1)
    rq, rs = R.quantize_per_token_int8(x)
    assert torch.equal(q1, rq) and torch.equal(s1, rs)
    amax = x.float().abs().amax(-1)
    # Two planes: half the second step; three: down to float32 rounding of the residuals.
    for planes, bound in [(2, 1 / 64516), (3, 2.0**-22)]:
        q, s = int8_native.quantize(x, planes)
        assert torch.equal(q[::planes], rq)  # the first plane of each row is the same
        back = (q.float() * s).view(6, planes, 200).sum(1)
        err = (back - x.float()).abs().amax(-1)
        assert bool((err <= amax * bound * 1.01).all()), (planes, err / amax)


def test_w8a8_is_close_to_the_float_layer():
    x, w, bias = _case(16, 256, 128, seed=2)
    q, scale = R.quantize_weight(w, torch.int8)
    out = Int8Linear(q, scale, bias)(x)
    want = torch.nn.functional.linear(x, w, bias)
    rel = (out - want).norm() / want.norm()
    assert rel < 0.02, rel


def test_bad_inputs_name_the_problem():
    q, scale = R.quantize_weight(torch.randn(8, 64), torch.int8, 32)
    with pytest.raises(ValueError, match="per-channel"):
        Int8Linear(q, scale, None)
    q, scale = R.quantize_weight(torch.randn(8, 64), torch.int8)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        Int8Linear(q, scale, None)(torch.randn(2, 63))
