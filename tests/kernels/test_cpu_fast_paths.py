"""The CPU engine's fast paths: oneDNN-packed linears, float32 linears with bf16-held
weights, bf16 norm/rotary against the reference, per-step plans reused across layers (and
rebuilt when the metadata changes), and the glibc heap tuning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.loader import resolve_dtype
from pdserve.kernels import ops
from pdserve.kernels import reference as R
from pdserve.kernels.cpu import native
from pdserve.kernels.cpu.linear import (
    Bf16Linear,
    Bf16WeightLinear,
    PackedLinear,
    _has_amx,
    can_pack,
    holds_bf16_values,
    pack_linears,
)
from pdserve.kernels.cpu.runtime import keep_freed_memory
from tests.kernels.cases import ATTN_TOL, assert_close, make_batch

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(
    not can_pack(torch.bfloat16, CPU), reason="CPU without native bfloat16 (AVX512-BF16/AMX)"
)


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(bias: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(layer)
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        torch.testing.assert_close(packed(x), F.linear(x, layer.weight, layer.bias))
    x3 = torch.randn(2, 5, 96, dtype=torch.bfloat16)  # leading dims are kept
    assert packed(x3).shape == (2, 5, 160)
    assert packed(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 160)


needs_avx512_bf16 = pytest.mark.skipif(
    not native.bf16_linear_available(), reason="CPU without AVX512-BF16 (or no compiler)"
)


@needs_avx512_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("in_features", "out_features"), [(96, 160), (33, 37), (768, 1280), (2560, 768)]
)
def test_bf16_linear_matches_a_float32_matmul(
    in_features: int, out_features: int, bias: bool
) -> None:
    # Odd K (a zero-padded last input pair), N not a multiple of the 32-wide tile, and every
    # row-tile shape up to 12 plus several L2 row blocks.
    torch.manual_seed(in_features + out_features)
    layer = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    fast = Bf16Linear(layer)
    w = layer.weight.double()
    b = None if layer.bias is None else layer.bias.double()
    for rows in (*range(1, 14), 24, 37, 300):
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        want = F.linear(x.double(), w, b)
        got = fast(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        # float32 sums rounded once to bf16: within one bf16 rounding of the exact result
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3)
        # ... and the same numbers oneDNN gives, up to the order of the float32 sums
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))
    strided = torch.randn(5, in_features + 7, dtype=torch.bfloat16)[:, 3 : 3 + in_features]
    torch.testing.assert_close(fast(strided), F.linear(strided, layer.weight, layer.bias))
    x3 = torch.randn(2, 5, in_features, dtype=torch.bfloat16)  # leading dims are kept
    assert fast(x3).shape == (2, 5, out_features)
    assert fast(torch.empty(0, in_features, dtype=torch.bfloat16)).shape == (0, out_features)


@needs_avx512_bf16
def test_bf16_linear_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        Bf16Linear(nn.Linear(8, 8))
    fast = Bf16Linear(nn.Linear(8, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 CPU input"):
        fast(torch.randn(2, 8))
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        fast(torch.randn(2, 9, dtype=torch.bfloat16))


@needs_bf16
def test_pack_linears_replaces_every_linear_and_keeps_tied_embeddings() -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(50, 32).to(torch.bfloat16)
    model = nn.ModuleDict(
        {"embed": embed, "proj": nn.Linear(32, 32), "head": nn.Linear(32, 50, bias=False)}
    ).to(torch.bfloat16)
    model["head"].weight = embed.weight  # tied, as in lm_head
    before = embed.weight.detach().clone()
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    expected = F.linear(x, embed.weight)
    assert pack_linears(model) == 2
    # AVX512-BF16 without AMX: the native kernel; elsewhere oneDNN's packed layout.
    kind = Bf16Linear if native.bf16_linear_available() and not _has_amx() else PackedLinear
    assert isinstance(model["proj"], kind) and isinstance(model["head"], kind)
    assert torch.equal(model["embed"].weight, before)  # the embedding still has its table
    torch.testing.assert_close(model["head"](x), expected)


@needs_bf16
def test_the_logits_projection_packs_into_a_float32_result_kernel() -> None:
    if not native.bf16_linear_available():
        pytest.skip("the native AVX512-BF16 kernel does not run here")
    torch.manual_seed(1)
    model = nn.ModuleDict({"lm_head": nn.Linear(64, 300, bias=False)}).to(torch.bfloat16)
    weight = model["lm_head"].weight.detach().float()
    assert pack_linears(model) == 1 and isinstance(model["lm_head"], Bf16Linear)
    x = torch.randn(5, 64)
    out = ops.linear_float32(x, model["lm_head"])
    assert out.dtype == torch.float32
    # float32 sums of x rounded once to bf16, never rounded to bf16 afterwards
    want = F.linear(x.to(torch.bfloat16).float(), weight)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_float32_and_non_cpu_models_are_not_packed() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    assert not can_pack(torch.float32, CPU)
    assert not can_pack(torch.bfloat16, torch.device("meta"))
    assert pack_linears(model) == 0 and isinstance(model[0], nn.Linear)


def test_auto_dtype_is_the_checkpoints_where_the_cpu_runs_it_natively() -> None:
    assert resolve_dtype("auto", torch.float32, CPU) == torch.float32
    native = can_pack(torch.bfloat16, CPU)
    assert resolve_dtype("auto", torch.bfloat16, CPU) == (
        torch.bfloat16 if native else torch.float32
    )
    assert resolve_dtype("auto", torch.float16, CPU) == torch.float32
    assert resolve_dtype("auto", torch.float16, torch.device("cuda")) == torch.float16
    assert resolve_dtype("float32", torch.bfloat16, CPU) == torch.float32
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", torch.bfloat16, CPU)


@pytest.mark.parametrize("rows", [1, 8, 600])
def test_bfloat16_rms_norm_and_rotary_match_the_reference(rows: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    res = torch.randn(rows, 256, dtype=torch.bfloat16)
    w = torch.randn(256, dtype=torch.bfloat16)
    out, new_res = ops.rms_norm(x, w, 1e-6, res)
    ref_out, ref_res = R.rms_norm_ref(x, w, 1e-6, res)
    assert torch.equal(new_res, ref_res)
    # One bf16 rounding apart at most (F.rms_norm vs the unfused float32 ops).
    torch.testing.assert_close(out, ref_out, atol=0, rtol=2**-7)
    assert (out != ref_out).float().mean() < 0.01

    cache = ops.build_rope_cache(64, 1000, 10000.0, None, torch.float32, "cpu")
    pos = torch.randint(0, 1000, (rows,))
    q = torch.randn(rows, 8, 64, dtype=torch.bfloat16)
    k = torch.randn(rows, 2, 64, dtype=torch.bfloat16)
    for got, want in zip(
        ops.apply_rotary(pos, q, k, cache), R.apply_rotary_ref(pos, q, k, cache), strict=True
    ):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want)  # same float32 products and sums, one rounding


def test_float32_rotary_is_bitwise_the_reference() -> None:
    torch.manual_seed(1)
    cache = ops.build_rope_cache(128, 600, 500000.0, None, torch.float32, "cpu")
    pos = torch.randint(0, 600, (33,))
    q, k = torch.randn(33, 4, 128), torch.randn(33, 1, 128)
    for got, want in zip(
        ops.apply_rotary(pos, q, k, cache), R.apply_rotary_ref(pos, q, k, cache), strict=True
    ):
        assert torch.equal(got, want)


def test_per_step_plans_follow_changes_to_the_metadata() -> None:
    """Layers share a step's gather plan; a changed block table or length (in place or a new
    tensor) or another cache must never reuse a stale one."""
    batch = make_batch(
        3,
        [1, 1, 1],
        [40, 17, 90],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
    )
    q, kc, vc, tables, lens, scale = batch.decode_args()
    tol = ATTN_TOL[torch.float32]
    for _ in range(2):  # the second call reuses the plan
        assert_close(
            ops.paged_decode_attention(q, kc, vc, tables, lens, scale),
            R.paged_decode_attention_ref(q, kc, vc, tables, lens, scale),
            tol,
        )
    lens[1] = 5  # in place: the version counter moves
    tables[0, :3] = tables[0, :3].flip(0)  # the 3 blocks of its 40 tokens, reordered
    assert_close(
        ops.paged_decode_attention(q, kc, vc, tables, lens, scale),
        R.paged_decode_attention_ref(q, kc, vc, tables, lens, scale),
        tol,
    )
    # Same tables, another (smaller) cache: ids are clamped to that cache, not reused.
    small_k, small_v = kc[: int(tables.max()) + 1].clone(), vc[: int(tables.max()) + 1].clone()
    assert_close(
        ops.paged_decode_attention(q, small_k, small_v, tables, lens, scale),
        R.paged_decode_attention_ref(q, kc, vc, tables, lens, scale),
        tol,
    )
    args = batch.attention_args()
    first = ops.paged_attention(*args)
    again = ops.paged_attention(*args)
    assert torch.equal(first, again)


def test_heap_tuning_is_applied_once() -> None:
    first = keep_freed_memory()
    assert isinstance(first, bool)
    assert keep_freed_memory() == first


needs_bf16w = pytest.mark.skipif(
    not native.bf16_weight_linear_available(), reason="no native kernel for AVX2 + FMA here"
)


def _bf16_valued_linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():  # as a bf16 checkpoint loaded in float32: bf16 values only
        layer.weight.copy_(layer.weight.to(torch.bfloat16).float())
    return layer


@needs_bf16w
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("in_features", "out_features"), [(96, 160), (33, 37), (768, 1280)])
def test_bf16_weight_linear_matches_the_float32_layer(
    in_features: int, out_features: int, bias: bool
) -> None:
    """Every row count the kernel tiles differently (1-6 rows per tile, several row blocks)
    and output counts that are not a multiple of its 16-column panels."""
    layer = _bf16_valued_linear(in_features, out_features, bias, seed=in_features)
    packed = Bf16WeightLinear(layer)
    assert packed.packed_weight.numel() * 4 == -(-out_features // 16) * 16 * in_features * 2
    for rows in (1, 2, 5, 6, 7, 8, 13, 32, 300):
        x = torch.randn(rows, in_features)
        b = None if layer.bias is None else layer.bias.double()
        expected = F.linear(x.double(), layer.weight.double(), b).float()
        torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, in_features)  # leading dims are kept
    torch.testing.assert_close(packed(x3), F.linear(x3, layer.weight, layer.bias))
    strided = torch.randn(4, 2 * in_features)[:, ::2]  # non-contiguous rows are copied
    torch.testing.assert_close(packed(strided), F.linear(strided, layer.weight, layer.bias))
    assert packed(torch.empty(0, in_features)).shape == (0, out_features)


@needs_bf16w
def test_bf16_weight_linear_refuses_what_it_cannot_compute_exactly() -> None:
    layer = nn.Linear(16, 16)
    assert not holds_bf16_values(layer.weight)  # a float32 init has more than bf16's bits
    with pytest.raises(ValueError, match="bfloat16 values only"):
        Bf16WeightLinear(layer)
    packed = Bf16WeightLinear(_bf16_valued_linear(16, 16, True, seed=1))
    with pytest.raises(ValueError, match=r"float32 CPU input \[\.\.\., 16\]"):
        packed(torch.randn(3, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[\.\.\., 16\]"):
        packed(torch.randn(3, 8))


@needs_bf16w
def test_pack_linears_holds_bf16_valued_float32_weights_as_bf16() -> None:
    exact = _bf16_valued_linear(32, 48, True, seed=2)
    model = nn.ModuleDict({"exact": exact, "full": nn.Linear(32, 32)})
    x = torch.randn(4, 32)
    expected = F.linear(x, exact.weight, exact.bias)
    if can_pack(torch.float32, CPU):  # never: oneDNN packing is for bf16 models
        pytest.fail("float32 must not take the oneDNN bf16 path")
    assert pack_linears(model) == 1
    assert isinstance(model["exact"], Bf16WeightLinear)
    assert isinstance(model["full"], nn.Linear)  # float32 values: left as it is
    torch.testing.assert_close(model["exact"](x), expected)
