"""The native CPU kernels (kernels/cpu/csrc: decode attention, and the layer ops RMSNorm, rotary,
SiLU-and-mul) against the references, their torch fallbacks, and how they are built: cached
per source/compiler/CPU, and absent (not an error) where they cannot be built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import ops
from pdserve.kernels import reference as R
from pdserve.kernels.cpu import batched as cpu
from pdserve.kernels.cpu import native
from tests.kernels.cases import ATTN_TOL, assert_close, make_batch

REPO = Path(__file__).resolve().parents[2]
has_compiler = shutil.which("c++") is not None or shutil.which("g++") is not None
needs_native = pytest.mark.skipif(not has_compiler, reason="no C++ compiler")

SHAPES = [
    # (num_q_heads, num_kv_heads, head_dim, block_size): MHA, GQA 4 and 8, MQA, odd head dim;
    # blocks smaller and larger than the 16 tokens the AVX-512 score pass takes at a time
    (4, 4, 64, 16),
    (4, 2, 64, 8),
    (8, 8, 128, 64),
    (12, 4, 64, 16),
    (16, 2, 128, 32),
    (8, 1, 128, 16),
    (6, 2, 80, 16),
]


def _decode_batch(seed: int, ctx_lens: list[int], hq: int, hkv: int, d: int, bs: int, dtype):
    return make_batch(
        seed,
        [1] * len(ctx_lens),
        ctx_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=dtype,
    )


@needs_native
def test_the_kernel_builds_where_a_compiler_is_present() -> None:
    # Losing the fast path silently (a broken build) would only show as a slower engine.
    assert native.available()


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), SHAPES)
def test_native_decode_matches_reference(hq, hkv, d, bs, dtype, threads) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # One sequence (heads split over threads), and a batch of lengths around block
        # boundaries up to ~1000 tokens (sequences split over threads).
        for ctx_lens in ([37], [1, bs - 1, bs, bs + 1, 333, 1000, 2 * bs]):
            batch = _decode_batch(3, ctx_lens, hq, hkv, d, bs, dtype)
            args = batch.decode_args()
            out = native.paged_decode_attention(*args)
            assert out is not None
            assert_close(out, R.paged_decode_attention_ref(*args), ATTN_TOL[dtype])
    finally:
        torch.set_num_threads(before)


@needs_native
def test_native_decode_reads_strided_queries_and_skips_empty_sequences() -> None:
    # The model's q is a view into the fused qkv projection: rows are strided.
    batch = _decode_batch(4, [5, 70, 9], 8, 2, 64, 16, torch.bfloat16)
    qkv = torch.randn(3, 8 * 64 + 2 * 2 * 64, dtype=torch.bfloat16)
    q = qkv[:, : 8 * 64].view(3, 8, 64)
    assert not q.is_contiguous()
    lens = torch.tensor([5, 0, 9], dtype=torch.int32)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, lens, batch.scale)
    out = native.paged_decode_attention(*args)
    assert out is not None
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = torch.tensor([0, 2])
    ref_args = (
        q[keep].contiguous(),
        batch.k_cache,
        batch.v_cache,
        batch.block_tables[keep],
        lens[keep],
        batch.scale,
    )
    assert_close(out[keep], R.paged_decode_attention_ref(*ref_args), ATTN_TOL[torch.bfloat16])


def test_unsupported_dtypes_are_left_to_torch() -> None:
    batch = _decode_batch(5, [20], 4, 2, 64, 16, torch.float16)
    assert native.paged_decode_attention(*batch.decode_args()) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_fallback_matches_reference(monkeypatch, dtype) -> None:
    # Machines without a compiler run the SDPA path: it must stay correct.
    monkeypatch.setattr(native, "paged_decode_attention", lambda *a: None)
    batch = _decode_batch(6, [1, 15, 16, 17, 300, 999], 12, 4, 64, 16, dtype)
    args = batch.decode_args()
    assert_close(
        cpu.paged_decode_attention_cpu(*args), R.paged_decode_attention_ref(*args), ATTN_TOL[dtype]
    )


def _probe(env: dict[str, str]) -> str:
    code = "from pdserve.kernels.cpu import native; print(native.available())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip() + "\n" + done.stderr


@needs_native
def test_builds_once_into_the_cache_and_reuses_it(tmp_path: Path) -> None:
    env = {"PDSERVE_KERNEL_CACHE": str(tmp_path)}
    assert _probe(env).startswith("True")
    built = list(tmp_path.glob("pdserve_native_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert _probe(env).startswith("True")
    assert [p.stat().st_mtime_ns for p in tmp_path.glob("pdserve_native_*.so")] == [stamp]
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".so" and p not in built]


def test_a_failing_compiler_leaves_the_torch_path(tmp_path: Path) -> None:
    out = _probe({"PDSERVE_KERNEL_CACHE": str(tmp_path), "CXX": "false"})
    assert out.startswith("False")
    assert "native CPU kernels unavailable" in out
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


def test_without_the_library_float32_linears_stay_on_torch(tmp_path: Path) -> None:
    code = (
        "import torch; from torch import nn; from pdserve.kernels.cpu import native, linear\n"
        "m = nn.Sequential(nn.Linear(16, 16))\n"
        "m[0].weight.data = m[0].weight.data.to(torch.bfloat16).float()\n"
        "print(native.bf16_weight_linear_available(), linear.pack_linears(m), type(m[0]).__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PDSERVE_KERNEL_CACHE": str(tmp_path), "CXX": "false"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.split() == ["False", "0", "Linear"]


def _ulps_apart(got: torch.Tensor, want: torch.Tensor) -> int:
    """Largest distance in units of the last place (the bit patterns of same-sign values)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if not got.numel():
        return 0
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    return int((got.view(bits).long() - want.view(bits).long()).abs().max())


LAYER_DTYPES = [torch.float32, torch.bfloat16]


@needs_native
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("dtype", LAYER_DTYPES, ids=str)
def test_native_rms_norm_matches_reference(rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    wide = torch.randn(rows, 1000).to(dtype)
    x = wide[:, 100:868]  # rows of a wider tensor: a row stride other than the width
    res = (torch.randn(rows, 768) * 3).to(dtype)
    w = (torch.rand(768) + 0.5).to(dtype)
    out, summed = native.rms_norm(x, w, 1e-5, res)
    ref_out, ref_sum = R.rms_norm_ref(x, w, 1e-5, res)
    assert torch.equal(summed, ref_sum)  # the residual stream is exactly torch's sum
    # The float32 sum of squares is taken in another order (and its order depends on the
    # vector width the CPU has), so float32 is held to the float64 truth, as torch's own
    # result is: within a few roundings. bfloat16 rounds that once more: 1-2 ulps of torch.
    plain = native.rms_norm(x, w, 1e-5, None)
    for got, want, r in ((out, ref_out, res), (plain, R.rms_norm_ref(x, w, 1e-5), None)):
        if dtype == torch.bfloat16:
            assert _ulps_apart(got, want) <= 2
            if rows:
                assert (got != want).float().mean() < 0.01
        elif rows:
            s = x.double() if r is None else x.double() + r.double()
            truth = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
            for value in (got, want):
                rel = ((value.double() - truth).abs() / truth.abs()).max().item()
                assert rel <= 4 * 2.0**-23, rel
    assert not res.isnan().any()  # inputs untouched: outputs are fresh tensors
    assert torch.equal(wide[:, 100:868], x)


@needs_native
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("dtype", LAYER_DTYPES, ids=str)
def test_native_rotary_is_bitwise_the_reference(rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    q_size, kv_size = 12 * 64, 4 * 64
    qkv = torch.randn(rows, q_size + 2 * kv_size).to(dtype)  # q and k are views into it
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(rows, 12, 64), k.view(rows, 4, 64)
    cache = R.build_rope_cache_ref(64, 4096, 500000.0, None, torch.float32, "cpu")
    pos = torch.randint(0, 4096, (rows,))
    rotated = native.rotary(cache[pos], q, k)
    assert rotated is not None
    for got, want in zip(rotated, R.apply_rotary_ref(pos, q, k, cache), strict=True):
        assert got.is_contiguous() and got.dtype == dtype
        assert torch.equal(got, want)  # the same float32 products and sums, one rounding


@needs_native
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("dtype", LAYER_DTYPES, ids=str)
def test_native_silu_and_mul_matches_reference(rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    x = (torch.randn(rows, 2 * 2560) * 6).to(dtype)  # deep into both tails of the sigmoid
    x[:1, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    got = native.silu_and_mul(x)
    want = R.silu_and_mul_ref(x)
    if dtype == torch.bfloat16:
        assert _ulps_apart(got, want) <= 1  # SiLU's exp differs from torch's in the last bit
        assert (got != want).float().mean() < 0.01 if rows else True
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_silu_and_mul_rejects_a_bad_shape() -> None:
    with pytest.raises(ValueError, match="x: expected"):
        ops.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="x: expected"):
        ops.silu_and_mul(torch.randn(8))


def test_layer_ops_leave_what_they_cannot_take_to_torch() -> None:
    half = torch.randn(4, 64, dtype=torch.float16)
    assert native.silu_and_mul(half) is None
    assert native.rms_norm(half, torch.ones(64, dtype=torch.float16), 1e-6, None) is None
    assert native.silu_and_mul(torch.randn(2, 3, 64)) is None  # 2-D only
    mixed = native.rms_norm(torch.randn(4, 64), torch.ones(64, dtype=torch.float16), 1e-6, None)
    assert mixed is None  # a float16 weight


@pytest.mark.parametrize("dtype", LAYER_DTYPES, ids=str)
def test_layer_ops_torch_fallback_matches_reference(monkeypatch, dtype) -> None:
    # Machines without a compiler keep the torch paths of kernels/cpu/batched.py.
    monkeypatch.setattr(native, "available", lambda: False)
    for name in ("rms_norm", "rotary", "silu_and_mul"):
        monkeypatch.setattr(native, name, lambda *a: None)
    torch.manual_seed(3)
    x, res = torch.randn(9, 256).to(dtype), torch.randn(9, 256).to(dtype)
    w = torch.randn(256).to(dtype)
    for got, want in zip(
        cpu.rms_norm_cpu(x, w, 1e-6, res), R.rms_norm_ref(x, w, 1e-6, res), strict=True
    ):
        assert _ulps_apart(got, want) <= (2 if dtype == torch.bfloat16 else 4)
    cache = R.build_rope_cache_ref(64, 100, 10000.0, None, torch.float32, "cpu")
    pos, q, k = torch.arange(9), torch.randn(9, 4, 64).to(dtype), torch.randn(9, 2, 64).to(dtype)
    for got, want in zip(
        cpu.apply_rotary_cpu(pos, q, k, cache), R.apply_rotary_ref(pos, q, k, cache), strict=True
    ):
        assert torch.equal(got, want)
    g = torch.randn(9, 512).to(dtype)
    torch.testing.assert_close(cpu.silu_and_mul_cpu(g), R.silu_and_mul_ref(g))


def test_bind_omp_team_needs_cpus_for_every_thread() -> None:
    with pytest.raises(ValueError, match="cpu_sets"):
        native.bind_omp_team([(0,), ()])
    with pytest.raises(ValueError, match="cpu_sets"):
        native.bind_omp_team([])
