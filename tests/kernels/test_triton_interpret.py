"""Every Triton kernel, run on CPU by Triton's interpreter, against its torch reference.

conftest.py sets TRITON_INTERPRET=1 (on machines without CUDA) before triton is imported.
The interpreter runs each program instance in Python, so shapes are small; lengths and ratios
still cover GQA 1/4/8, head dims 64/128, block sizes 16/32, contexts 1..~1000 and mixed
batches.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from tests.kernels.conftest import TRITON_IMPORTED_TOO_EARLY

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA machine: test_gpu_check covers the compiled kernels", allow_module_level=True)
if TRITON_IMPORTED_TOO_EARLY:
    pytest.skip("triton was imported before TRITON_INTERPRET was set", allow_module_level=True)

from pdserve.kernels import reference as R  # noqa: E402
from pdserve.kernels.triton.activation import silu_and_mul_triton  # noqa: E402
from pdserve.kernels.triton.decode import paged_decode_attention_triton  # noqa: E402
from pdserve.kernels.triton.kv import (  # noqa: E402
    gather_blocks_triton,
    scatter_blocks_triton,
    write_kv_triton,
)
from pdserve.kernels.triton.norm import rms_norm_triton  # noqa: E402
from pdserve.kernels.triton.prefill import paged_attention_triton  # noqa: E402
from pdserve.kernels.triton.rotary import apply_rotary_triton  # noqa: E402
from tests.kernels.cases import (  # noqa: E402
    ATTN_TOL,
    ELEMENTWISE_TOL,
    assert_close,
    make_batch,
    random_lengths,
    rms_norm_bound,
    silu_bound,
)

DTYPES = [torch.float32, torch.bfloat16]
# (head_dim, query heads per KV head, block_size, dtype); KV heads: 2, or 1 for ratio 8.
ATTN_CASES = list(itertools.product([64, 128], [1, 4, 8], [16, 32], DTYPES))


def _case_id(case: tuple) -> str:
    d, ratio, bs, dtype = case
    return f"d{d}-g{ratio}-b{bs}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("case", ATTN_CASES, ids=_case_id)
def test_decode_kernel_matches_reference(case: tuple) -> None:
    d, ratio, bs, dtype = case
    hkv = 1 if ratio == 8 else 2
    seed = ATTN_CASES.index(case)
    ctx_lens = [1, bs + 1, int(torch.randint(2, 1000, (1,), generator=torch.manual_seed(seed)))]
    batch = make_batch(
        seed,
        [1] * len(ctx_lens),
        ctx_lens,
        num_q_heads=hkv * ratio,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=dtype,
    )
    args = batch.decode_args()
    expected = R.paged_decode_attention_ref(*args)
    # Alternate the single-pass kernel and the split + reduce (flash-decoding) path.
    got = paged_decode_attention_triton(*args, num_splits=1 if seed % 2 else 4)
    assert_close(got, expected, ATTN_TOL[dtype])


@pytest.mark.parametrize("case", ATTN_CASES, ids=_case_id)
def test_prefill_kernel_matches_reference_on_mixed_batch(case: tuple) -> None:
    d, ratio, bs, dtype = case
    hkv = 1 if ratio == 8 else 2
    seed = ATTN_CASES.index(case)
    # Small shapes for most cases (the interpreter is slow); every sixth has contexts to ~1000.
    max_ctx = 1000 if seed % 6 == 0 else 160
    q_lens, ctx_lens = random_lengths(seed, 3, max_ctx=max_ctx, max_new=48)
    batch = make_batch(
        seed,
        q_lens,
        ctx_lens,
        num_q_heads=hkv * ratio,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=dtype,
    )
    args = batch.attention_args()
    # Small query tiles on some cases so sequences span several tiles.
    got = paged_attention_triton(*args, block_m=16 if seed % 3 == 0 else None)
    assert_close(got, R.paged_attention_ref(*args), ATTN_TOL[dtype])


def test_decode_kernel_float16() -> None:
    batch = make_batch(
        7,
        [1, 1, 1],
        [3, 64, 301],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
    )
    args = batch.decode_args()
    expected = R.paged_decode_attention_ref(*args)
    assert_close(
        paged_decode_attention_triton(*args, num_splits=3), expected, ATTN_TOL[torch.float16]
    )


def test_prefill_kernel_whole_prompts_and_float16() -> None:
    # Plain prefill (no cached prefix, q_len == context) and a float16 cache.
    batch = make_batch(
        99,
        [37, 5, 64],
        [37, 5, 64],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
    )
    args = batch.attention_args()
    assert_close(
        paged_attention_triton(*args), R.paged_attention_ref(*args), ATTN_TOL[torch.float16]
    )


@pytest.mark.parametrize(("dtype", "bs"), [(torch.float32, 16), (torch.bfloat16, 32)], ids=str)
def test_write_kv_kernel_matches_reference(dtype: torch.dtype, bs: int) -> None:
    gen = torch.Generator().manual_seed(bs)
    k_cache = torch.randn(6, bs, 2, 64, generator=gen).to(dtype)
    v_cache = torch.randn(6, bs, 2, 64, generator=gen).to(dtype)
    key = torch.randn(9, 2, 64, generator=gen).to(dtype)
    value = torch.randn(9, 2, 64, generator=gen).to(dtype)
    slots = torch.randperm(6 * bs, generator=gen)[:9]
    slots[[2, 7]] = -1  # padding tokens
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    R.write_kv_ref(key, value, k_ref, v_ref, slots)
    write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_plane_write_stores_each_key_once(dtype: torch.dtype) -> None:
    """An MLA pool's one plane: the keys land at their slots, nothing else changes."""
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(4, 16, 1, 24, generator=gen).to(dtype)
    key = torch.randn(7, 1, 24, generator=gen).to(dtype)
    slots = torch.tensor([3, 17, -1, 40, 63, 0, 22])
    want = cache.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s // 16, s % 16] = key[i]
    write_kv_triton(key, None, cache, None, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead", [(2,), (3, 2)], ids=["one-layer", "all-layers"])
def test_gather_scatter_kernels_match_reference(lead: tuple[int, ...], dtype) -> None:
    gen = torch.Generator().manual_seed(len(lead))
    kv = torch.randn(*lead, 9, 16, 2, 32, generator=gen).to(dtype)
    ids = torch.tensor([7, 0, 4, 8])
    packed = gather_blocks_triton(kv, ids)
    assert packed.is_contiguous()
    assert torch.equal(packed, R.gather_blocks_ref(kv, ids))
    dest, dest_ref = torch.zeros_like(kv), torch.zeros_like(kv)
    new_ids = torch.tensor([1, 2, 6, 3])
    scatter_blocks_triton(packed, dest, new_ids)
    R.scatter_blocks_ref(packed, dest_ref, new_ids)
    assert torch.equal(dest, dest_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_kernel_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=gen).to(dtype)  # hidden not a power of two
    w = torch.randn(96, generator=gen).to(dtype)
    r = torch.randn(5, 96, generator=gen).to(dtype)
    atol, rtol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(
        rms_norm_triton(x, w, 1e-6), R.rms_norm_ref(x, w, 1e-6), atol=atol, rtol=rtol
    )
    out, res = rms_norm_triton(x, w, 1e-6, r)
    ref_out, ref_res = R.rms_norm_ref(x, w, 1e-6, r)
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(res, ref_res, atol=atol, rtol=rtol)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rms_norm_kernel_keeps_the_float32_stream(out_dtype: torch.dtype) -> None:
    """The model's call: a bf16 layer output onto the float32 residual stream; the sum
    exact to float32, the output within one rounding of float64 (test_layer_numerics)."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 768, generator=gen) * 2).bfloat16()
    stream = torch.randn(4, 768, generator=gen) * 5
    w = (torch.rand(768, generator=gen) + 0.5).bfloat16()
    out, summed = rms_norm_triton(x, w, 1e-5, stream, out_dtype)
    assert out.dtype == out_dtype and summed.dtype == torch.float32
    s = x.double() + stream.double()
    truth = w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert ((summed.double() - s).abs() <= 2.0**-24 * s.abs()).all()
    bound = rms_norm_bound(truth, 768, out_dtype, truncating=True)  # the interpreter's cast
    assert ((out.double() - truth).abs() <= bound).all()


def test_silu_and_mul_kernel_rounds_once() -> None:
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 2 * 1500, generator=gen) * 4).bfloat16()  # a partial column block
    got = silu_and_mul_triton(x)
    gate, up = x.double().chunk(2, dim=-1)
    truth = gate * torch.sigmoid(gate) * up
    assert got.dtype == torch.bfloat16 and got.shape == (3, 1500)
    # Triton's exp is not the CPU kernel's polynomial; the same bound holds (exp to 2^-23).
    assert ((got.double() - truth).abs() <= silu_bound(truth, truncating=True)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_kernel_matches_reference(head_dim: int, dtype: torch.dtype) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    cache = R.build_rope_cache_ref(head_dim, 2048, 500000.0, scaling, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 2048, (6,), generator=gen)
    q = torch.randn(6, 8, head_dim, generator=gen).to(dtype)
    # k as a strided view (as when sliced out of a fused qkv projection)
    k = torch.randn(6, 3, head_dim, generator=gen).to(dtype)[:, 1:]
    atol, rtol = ELEMENTWISE_TOL[dtype]
    got_q, got_k = apply_rotary_triton(positions, q, k, cache)
    ref_q, ref_k = R.apply_rotary_ref(positions, q, k, cache)
    torch.testing.assert_close(got_q, ref_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(got_k, ref_k, atol=atol, rtol=rtol)


def test_kernels_use_64_bit_offsets_past_2_31_elements() -> None:
    """Blocks beyond element 2**31 of the cache: int32 offsets would wrap and read/write the
    wrong memory. torch.empty only reserves address space, so this touches a few MB."""
    block_size, head_dim = 16, 16
    num_blocks = (1 << 31) // (block_size * head_dim) + 64
    kv = torch.empty(2, num_blocks, block_size, 1, head_dim, dtype=torch.bfloat16)
    k_cache, v_cache = kv[0], kv[1]
    assert k_cache.numel() > 2**31
    ids = torch.arange(num_blocks - 5, num_blocks, dtype=torch.int64)  # the last 5 blocks
    gen = torch.Generator().manual_seed(0)
    kv[:, ids] = torch.randn(2, 5, block_size, 1, head_dim, generator=gen).to(torch.bfloat16)

    # write_kv: three new tokens into the last block
    key = torch.randn(3, 1, head_dim, generator=gen).to(torch.bfloat16)
    value = torch.randn(3, 1, head_dim, generator=gen).to(torch.bfloat16)
    slots = ids[-1] * block_size + torch.tensor([0, 5, 15])
    write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[ids[-1], [0, 5, 15]], key)
    assert torch.equal(v_cache[ids[-1], [0, 5, 15]], value)

    # attention reading those blocks (decode with splits, and a chunked prefill)
    table = ids.flip(0).to(torch.int32)[None]  # [1, 5]
    seq_lens = torch.tensor([5 * block_size - 3], dtype=torch.int32)
    q = torch.randn(1, 4, head_dim, generator=gen).to(torch.bfloat16)
    args = (q, k_cache, v_cache, table, seq_lens)
    expected = R.paged_decode_attention_ref(*args, 0.25)
    assert_close(paged_decode_attention_triton(*args, 0.25, num_splits=2), expected, 2e-2)
    q_chunk = torch.randn(20, 4, head_dim, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    pargs = (q_chunk, k_cache, v_cache, cu, seq_lens, table, 0.25)
    assert_close(paged_attention_triton(*pargs), R.paged_attention_ref(*pargs), 2e-2)

    # gather those blocks from both K and V, scatter them back shifted by one block
    packed = gather_blocks_triton(kv, ids[:2])
    assert torch.equal(packed, kv[:, ids[:2]])
    scatter_blocks_triton(packed, kv, ids[-2:])
    assert torch.equal(kv[:, ids[-2:]], packed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_kernels_on_an_mla_latent_head(dtype: torch.dtype) -> None:
    """DeepSeek-V3's absorbed MLA: 16 query heads (one CUDA call's share) on one 576-wide
    latent head (a head size that is no power of two), decode and mixed batches."""
    heads = {"num_q_heads": 16, "num_kv_heads": 1, "head_dim": 576}
    q_lens, ctx_lens = random_lengths(11, 3, max_ctx=70, max_new=20)
    mixed = make_batch(11, q_lens, ctx_lens, **heads, block_size=16, dtype=dtype)
    args = mixed.attention_args()
    assert_close(paged_attention_triton(*args), R.paged_attention_ref(*args), ATTN_TOL[dtype])
    dec = make_batch(11, [1] * 3, ctx_lens, **heads, block_size=16, dtype=dtype).decode_args()
    want = R.paged_decode_attention_ref(*dec)
    assert_close(paged_decode_attention_triton(*dec, num_splits=2), want, ATTN_TOL[dtype])
