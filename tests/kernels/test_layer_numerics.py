"""The fused layer ops in bfloat16 against float64 truth, with bounds derived from rounding.

Notation: u32 = 2^-24 and u16 = 2^-8 are the unit roundoffs of float32 and bfloat16 (half an
ulp, relative). An op that computes in float32 and rounds its result once to bfloat16 is
within ``u16 * |truth|`` plus the float32 error of its arithmetic, which is a small multiple
of u32 (spelled out per op). An op that rounded an intermediate to bfloat16 (as HF's RMSNorm
does twice, and as a bf16 residual stream does at every layer) would break these bounds.

Every path is checked: the native kernels (where a compiler is), the torch fallback of
``kernels/cpu/batched.py``, the reference, and the Triton kernels under TRITON_INTERPRET in
``test_triton_interpret.py`` (same bounds, imported from here).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import ops
from pdserve.kernels import reference as R
from pdserve.kernels.cpu import batched as cpu
from pdserve.kernels.cpu import native
from pdserve.kernels.cpu.linear import Bf16Linear
from tests.kernels.cases import U16, U32, rms_norm_bound, silu_bound

H = 768


def _rms_truth(x, w, eps, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.double() if residual is None else x.double() + residual.double()
    return w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps), s


def _paths() -> list[str]:
    return ["native", "torch", "reference"] if native.available() else ["torch", "reference"]


def _rms_norm(path: str, *args, **kwargs):
    if path == "native":
        return native.rms_norm(*args, **kwargs)
    if path == "torch":
        fused = native.rms_norm
        try:
            native.rms_norm = lambda *a, **k: None  # type: ignore[assignment]
            return cpu.rms_norm_cpu(*args, **kwargs)
        finally:
            native.rms_norm = fused  # type: ignore[assignment]
    return R.rms_norm_ref(*args, **kwargs)


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_residual_rms_norm_rounds_once(path: str, out_dtype: torch.dtype) -> None:
    """A bf16 layer output added to the float32 residual stream: the stream is float32 to
    one rounding, the normalised output within one rounding of the float64 truth."""
    torch.manual_seed(0)
    x = (torch.randn(300, H) * 2).bfloat16()
    stream = torch.randn(300, H) * 5  # not representable in bf16: a rounding would show
    w = (torch.rand(H) + 0.5).bfloat16()
    out, summed = _rms_norm(path, x, w, 1e-5, stream, out_dtype=out_dtype)
    assert out.dtype == out_dtype and summed.dtype == torch.float32
    truth, s = _rms_truth(x, w, 1e-5, stream)
    assert ((summed.double() - s).abs() <= U32 * s.abs()).all()
    err = (out.double() - truth).abs()
    assert (err <= rms_norm_bound(truth, H, out_dtype)).all(), float((err / truth.abs()).max())


@pytest.mark.parametrize("path", _paths())
def test_rms_norm_without_residual_rounds_once(path: str) -> None:
    torch.manual_seed(1)
    x = (torch.randn(64, H) * 3).bfloat16()
    w = (torch.rand(H) * 2 - 1).bfloat16()
    out = _rms_norm(path, x, w, 1e-6, None)
    truth, _ = _rms_truth(x, w, 1e-6)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - truth).abs() <= rms_norm_bound(truth, H, torch.bfloat16)).all()


def test_rounding_the_normalised_value_first_breaks_the_bound() -> None:
    """The bound is tight enough to tell: HF's order (normalised value rounded to bf16, then
    the weight product rounded again) exceeds it on some elements."""
    torch.manual_seed(0)
    x, w = (torch.randn(300, H) * 2).bfloat16(), (torch.rand(H) + 0.5).bfloat16()
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    hf = w * normed
    truth, _ = _rms_truth(x, w, 1e-5)
    assert ((hf.double() - truth).abs() > rms_norm_bound(truth, H, torch.bfloat16)).any()


@pytest.mark.parametrize("path", ["native", "torch", "reference"])
def test_silu_and_mul_rounds_once(path: str) -> None:
    if path == "native" and not native.available():
        pytest.skip("no native kernels")
    torch.manual_seed(2)
    x = (torch.randn(64, 2 * 2560) * 4).bfloat16()  # both tails of the sigmoid
    if path == "native":
        got = native.silu_and_mul(x)
    elif path == "torch":
        fused = native.silu_and_mul
        try:
            native.silu_and_mul = lambda *a: None  # type: ignore[assignment]
            got = cpu.silu_and_mul_cpu(x)
        finally:
            native.silu_and_mul = fused  # type: ignore[assignment]
    else:
        got = R.silu_and_mul_ref(x)
    gate, up = x.double().chunk(2, dim=-1)
    truth = gate * torch.sigmoid(gate) * up
    assert got.dtype == torch.bfloat16
    assert ((got.double() - truth).abs() <= silu_bound(truth)).all()


def test_rotary_is_within_one_rounding_of_float64() -> None:
    """q' = x1 cos - x2 sin (and its pair) from the float32 table: two products and a sum
    in float32 (3 u32 of |x1 cos| + |x2 sin|, cancellation included), one bf16 rounding."""
    torch.manual_seed(3)
    cache = ops.build_rope_cache(64, 4096, 500000.0, None, torch.float32, "cpu")
    pos = torch.randint(0, 4096, (200,))
    q, k = torch.randn(200, 8, 64).bfloat16(), torch.randn(200, 2, 64).bfloat16()
    got_q, got_k = ops.apply_rotary(pos, q, k, cache)
    rows = cache[pos].double()[:, None]
    cos, sin = rows[..., :32], rows[..., 32:]
    for got, x in ((got_q, q), (got_k, k)):
        x1, x2 = x.double()[..., :32], x.double()[..., 32:]
        truth = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
        scale = torch.cat([(x1 * cos).abs() + (x2 * sin).abs()] * 2, -1)
        bound = U16 * truth.abs() + 3 * U32 * scale * (1 + U16)
        assert ((got.double() - truth).abs() <= bound).all()


@pytest.mark.skipif(not native.bf16_linear_available(), reason="no AVX512-BF16 kernel")
def test_float32_logits_from_bf16_weights() -> None:
    """The logits' projection: x rounded once to bf16 (the kernel's input), products of
    bf16 values exact in float32, K float32 sums each rounding by u32, the result kept in
    float32. With all terms positive, sum |w x| = |y| and the bound is relative."""
    torch.manual_seed(4)
    k, n = 768, 1000
    layer = torch.nn.Linear(k, n, bias=False).bfloat16()
    layer.weight.data = torch.rand(n, k).bfloat16()
    x = torch.rand(5, k) + 0.1
    packed = Bf16Linear(layer)
    got = ops.linear_float32(x, packed)
    truth = x.bfloat16().double() @ layer.weight.double().t()
    assert got.dtype == torch.float32
    bound = (k + 1) * U32 * truth.abs()
    assert ((got.double() - truth).abs() <= bound).all()
    # The bf16 layer's result (rounded to bf16) is far outside that bound.
    rounded = packed(x.bfloat16()).double()
    assert ((rounded - truth).abs() > bound).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_float32_logits_from_an_unpacked_layer(dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    layer = torch.nn.Linear(64, 300, bias=True).to(dtype)
    layer.bias.data = torch.rand(300).to(dtype)
    layer.weight.data = torch.rand(300, 64).to(dtype)
    x = torch.rand(3, 64)
    got = ops.linear_float32(x, layer)
    truth = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert got.dtype == torch.float32 and got.shape == (3, 300)
    assert ((got.double() - truth).abs() <= 2 * 65 * U32 * truth.abs()).all()
    with pytest.raises(ValueError, match="x: expected"):
        ops.linear_float32(torch.rand(2, 3, 64), layer)
