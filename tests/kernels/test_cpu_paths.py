"""pdserve.kernels.ops on CPU tensors (the engine's CPU path) against pdserve.kernels.reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import ops
from pdserve.kernels import reference as R
from tests.kernels.cases import ATTN_TOL, ELEMENTWISE_TOL, assert_close, make_batch, random_lengths

REPO = Path(__file__).resolve().parents[2]

SHAPES = [
    # (num_q_heads, num_kv_heads, head_dim, block_size)
    (2, 2, 64, 16),
    (8, 2, 128, 32),
    (8, 1, 64, 32),
    (16, 2, 128, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), SHAPES)
def test_mixed_batch_matches_reference(hq: int, hkv: int, d: int, bs: int, dtype) -> None:
    for seed in range(2):
        q_lens, ctx_lens = random_lengths(seed, 6, max_ctx=1000, max_new=300)
        batch = make_batch(
            seed,
            q_lens,
            ctx_lens,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            block_size=bs,
            dtype=dtype,
        )
        args = batch.attention_args()
        assert_close(ops.paged_attention(*args), R.paged_attention_ref(*args), ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), SHAPES)
def test_decode_matches_reference(hq: int, hkv: int, d: int, bs: int, dtype) -> None:
    ctx_lens = [1, bs - 1, bs, bs + 1, 333, 1000]
    batch = make_batch(
        11,
        [1] * len(ctx_lens),
        ctx_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=dtype,
    )
    args = batch.decode_args()
    assert_close(
        ops.paged_decode_attention(*args), R.paged_decode_attention_ref(*args), ATTN_TOL[dtype]
    )


def test_prefill_groups_with_very_different_lengths() -> None:
    # A long prefill next to short ones goes into separate padded groups; results must not
    # depend on how the batch was grouped.
    q_lens, ctx_lens = [900, 3, 2, 40, 1], [1000, 3, 700, 40, 9]
    batch = make_batch(
        5,
        q_lens,
        ctx_lens,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
    )
    args = batch.attention_args()
    assert_close(ops.paged_attention(*args), R.paged_attention_ref(*args), ATTN_TOL[torch.float32])


def test_decode_of_empty_sequence_is_zero() -> None:
    batch = make_batch(
        1,
        [1, 1],
        [5, 7],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
    )
    seq_lens = torch.tensor([0, 7], dtype=torch.int32)
    out = ops.paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, batch.scale
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out).all()


def test_write_kv_gather_scatter_rms_rotary_dispatch_to_reference() -> None:
    torch.manual_seed(0)
    k_cache, v_cache = torch.zeros(5, 16, 2, 64), torch.zeros(5, 16, 2, 64)
    key, value = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    slots = torch.tensor([3, -1, 40, 79])
    ops.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[2, 8], key[2]) and torch.equal(v_cache[4, 15], value[3])

    kv = torch.randn(2, 2, 6, 16, 2, 64)
    ids = torch.tensor([4, 1])
    packed = ops.gather_blocks(kv, ids)
    assert torch.equal(packed, kv[:, :, [4, 1]])
    dest = torch.zeros_like(kv)
    ops.scatter_blocks(packed, dest, torch.tensor([0, 5]))
    assert torch.equal(dest[:, :, [0, 5]], kv[:, :, [4, 1]])

    x, w, r = torch.randn(3, 96), torch.randn(96), torch.randn(3, 96)
    out, new_res = ops.rms_norm(x, w, 1e-6, r)
    ref_out, ref_res = R.rms_norm_ref(x, w, 1e-6, r)
    assert_close(out, ref_out, ELEMENTWISE_TOL[torch.float32][0])
    assert torch.equal(new_res, ref_res)

    cache = ops.build_rope_cache(64, 50, 10000.0, None, torch.float32, "cpu")
    assert cache.shape == (50, 64)
    pos = torch.tensor([0, 49, 7])
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    q_rot, k_rot = ops.apply_rotary(pos, q, k, cache)
    assert torch.equal(q_rot[0], q[0])  # position 0 is the identity
    # rotation preserves each head's norm
    assert_close(q_rot.norm(dim=-1), q.norm(dim=-1), 1e-4)
    assert_close(k_rot.norm(dim=-1), k.norm(dim=-1), 1e-4)


def test_dispatch_rejects_bad_shapes() -> None:
    batch = make_batch(
        0,
        [1],
        [4],
        num_q_heads=3,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
    )
    with pytest.raises(ValueError, match="q:"):
        ops.paged_attention(*batch.attention_args())
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.write_kv(
            torch.zeros(2, 2, 64),
            torch.zeros(2, 2, 64),
            batch.k_cache,
            batch.v_cache,
            torch.zeros(3, dtype=torch.int64),
        )
    with pytest.raises(ValueError, match="buf"):
        ops.scatter_blocks(torch.zeros(1, 16, 2, 64), batch.k_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-6)


def test_float16_mixed_batch_matches_reference() -> None:
    q_lens, ctx_lens = random_lengths(4, 5, max_ctx=400, max_new=100)
    batch = make_batch(
        4,
        q_lens,
        ctx_lens,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
    )
    args = batch.attention_args()
    assert_close(ops.paged_attention(*args), R.paged_attention_ref(*args), ATTN_TOL[torch.float16])


def test_cpu_ops_run_without_triton() -> None:
    """ops must not import triton for CPU tensors: run them with triton made unimportable."""
    code = """
import sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton blocked for this test")
sys.meta_path.insert(0, _NoTriton())
import torch
from pdserve.kernels import ops
from pdserve.kernels.testing import make_batch
b = make_batch(0, [1, 5], [9, 20], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
               dtype=torch.float32)
out = ops.paged_attention(*b.attention_args())
assert torch.isfinite(out).all()
ops.write_kv(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), b.k_cache, b.v_cache, torch.tensor([0]))
assert "triton" not in sys.modules
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), SHAPES)
def test_equal_length_whole_prompts_batched_with_decodes(
    hq: int, hkv: int, d: int, bs: int, dtype
) -> None:
    # Three prompts of one length share an SDPA call; another length, a prefill chunk after
    # a cached prefix and decodes ride along in the same step.
    q_lens = [70, 1, 70, 33, 70, 20, 1]
    ctx_lens = [70, 90, 70, 33, 70, 60, 5]
    batch = make_batch(
        3,
        q_lens,
        ctx_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=dtype,
    )
    args = batch.attention_args()
    assert_close(ops.paged_attention(*args), R.paged_attention_ref(*args), ATTN_TOL[dtype])


def test_write_kv_with_padding_slots_and_bfloat16_cache() -> None:
    k_cache = torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([-1, 0, 31, -1, 9])
    ops.write_kv(key, value, k_cache, v_cache, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    R.write_kv_ref(key, value, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert k_cache.count_nonzero() == ref_k.count_nonzero() > 0


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=str)
def test_one_plane_write_stores_keys_only(kv_dtype: torch.dtype) -> None:
    """An MLA pool's one plane: each key at its slot (quantized with the layer's scale for
    an int8 pool), padding slots skipped, the rest untouched."""
    cache = torch.zeros(4, 8, 1, 24, dtype=kv_dtype)
    key = torch.randn(5, 1, 24)
    slots = torch.tensor([-1, 0, 31, -1, 9])
    scale = torch.tensor([0.05]) if kv_dtype == torch.int8 else None
    ops.write_kv(key, None, cache, None, slots, scale)
    stored = cache.view(32, 1, 24)[[0, 31, 9]].float() * (1.0 if scale is None else scale)
    tol = 0.0 if scale is None else 0.5 * float(scale)
    assert (stored - key[[1, 2, 4]]).abs().max() <= tol
    assert cache.view(32, 24).abs().sum(dim=1).count_nonzero() == 3


def test_write_kv_refuses_a_value_without_its_plane() -> None:
    cache = torch.zeros(4, 8, 1, 24)
    key = torch.randn(2, 1, 24)
    with pytest.raises(ValueError, match="value/v_cache: give both"):
        ops.write_kv(key, key, cache, None, torch.tensor([0, 1]))
