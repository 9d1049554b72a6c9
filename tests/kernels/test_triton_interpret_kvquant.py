"""The Triton KV write and attention kernels over an int8 / float8 cache, run by Triton's
interpreter, against the torch references of ``pdserve.kernels.kv_quant``."""

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

from pdserve.kernels import kv_quant  # noqa: E402
from pdserve.kernels.testing import make_batch, quantize_batch, random_lengths  # noqa: E402
from pdserve.kernels.triton.decode import paged_decode_attention_triton  # noqa: E402
from pdserve.kernels.triton.kv import write_kv_triton  # noqa: E402
from pdserve.kernels.triton.prefill import paged_attention_triton  # noqa: E402
from tests.kernels.cases import quantized_case  # noqa: E402

KV_DTYPES = [torch.int8, torch.float8_e4m3fn]


def _ids(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_write_kv_kernel_stores_the_reference_bytes(kv_dtype, dtype):
    g = torch.Generator().manual_seed(5)
    t, h, d, n, b = 9, 3, 40, 4, 8  # odd head count and head size: masked lanes
    key = (torch.randn(t, h, d, generator=g) * 2).to(dtype)
    value = torch.randn(t, h, d, generator=g).to(dtype)
    k_scale = torch.tensor([0.01, 0.02, 0.005])  # small scales: some values clamp
    v_scale = torch.tensor([0.03, 0.01, 0.02])
    slots = torch.randperm(n * b, generator=g)[:t]
    slots[0] = -1
    caches = [torch.zeros(n, b, h, d, dtype=kv_dtype) for _ in range(4)]
    write_kv_triton(key, value, caches[0], caches[1], slots, k_scale, v_scale)
    kv_quant.write_kv_quant_ref(key, value, caches[2], caches[3], slots, k_scale, v_scale)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("ratio", [1, 4])
def test_attention_kernels_over_a_quantized_cache_match_reference(kv_dtype, dtype, ratio):
    seed = ratio + 3 * KV_DTYPES.index(kv_dtype)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    _, qd, ks, vs = quantized_case(seed, [1] * 3, [1, 17, 300], ratio, dtype, kv_dtype)
    want = kv_quant.paged_attention_quant_ref(*qd.attention_args(), ks, vs)
    for splits in (1, 4):
        got = paged_decode_attention_triton(
            *qd.decode_args(), num_splits=splits, k_scale=ks, v_scale=vs
        )
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)

    q_lens, ctx_lens = random_lengths(seed, 3, max_ctx=140, max_new=40)
    _, qm, ks, vs = quantized_case(seed, q_lens, ctx_lens, ratio, dtype, kv_dtype)
    got = paged_attention_triton(*qm.attention_args(), k_scale=ks, v_scale=vs)
    want = kv_quant.paged_attention_quant_ref(*qm.attention_args(), ks, vs)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


def test_softcap_and_window_over_a_quantized_cache():
    batch = make_batch(
        2, [1, 20], [90, 60], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32,
    )  # fmt: skip
    qb, ks, vs = quantize_batch(batch, torch.int8)
    from pdserve.kernels import reference as R

    k = kv_quant.dequantize_kv(qb.k_cache, ks, torch.float32)
    v = kv_quant.dequantize_kv(qb.v_cache, vs, torch.float32)
    a = qb.attention_args()
    want = R.paged_attention_ref(a[0], k, v, *a[3:], sliding_window=32, softcap=5.0)
    got = paged_attention_triton(*a, sliding_window=32, softcap=5.0, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
