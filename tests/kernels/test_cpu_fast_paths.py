"""The CPU engine's fast paths: oneDNN-packed linears, bf16 norm/rotary against the
reference, per-step plans reused across layers (and rebuilt when the metadata changes), and
the glibc heap tuning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_memory import keep_freed_memory
from engine.loader import resolve_dtype
from kernels import ops
from kernels import reference as R
from kernels.linear import PackedLinear, can_pack, pack_linears
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
    assert isinstance(model["proj"], PackedLinear) and isinstance(model["head"], PackedLinear)
    assert torch.equal(model["embed"].weight, before)  # the embedding still has its table
    torch.testing.assert_close(model["head"](x), expected)


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
