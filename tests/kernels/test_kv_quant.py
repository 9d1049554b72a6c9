"""The int8 / float8 KV cache on the CPU path: quantized writes, and attention that reads
the quantized cache, against the torch references of ``pdserve.kernels.kv_quant``."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import kv_quant, ops
from pdserve.kernels import reference as R
from pdserve.kernels.testing import random_lengths
from tests.kernels.cases import quantized_case

KV_DTYPES = [torch.int8, torch.float8_e4m3fn]
# Worst relative rounding error of one element: int8 half a step of absmax / 127, e4m3
# half an ulp of its 3 mantissa bits.
_REL = {torch.int8: 0.5 / 127, torch.float8_e4m3fn: 2.0**-4}


def _ids(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=_ids)
def test_write_kv_quantizes_into_the_slots_and_dequantizes_close(kv_dtype):
    g = torch.Generator().manual_seed(3)
    t, h, d, n, b = 11, 2, 64, 5, 4
    key, value = torch.randn(t, h, d, generator=g), torch.randn(t, h, d, generator=g) * 3
    k_scale = key.abs().amax(dim=(0, 2)) / kv_quant.kv_qmax(kv_dtype)
    v_scale = value.abs().amax(dim=(0, 2)) / kv_quant.kv_qmax(kv_dtype)
    slots = torch.randperm(n * b, generator=g)[:t]
    slots[3] = -1  # a padding token writes nothing
    caches = [torch.zeros(n, b, h, d, dtype=kv_dtype) for _ in range(4)]
    ops.write_kv(key, value, caches[0], caches[1], slots, k_scale, v_scale)
    kv_quant.write_kv_quant_ref(key, value, caches[2], caches[3], slots, k_scale, v_scale)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    keep = slots >= 0
    flat = caches[0].view(n * b, h, d)[slots[keep]]
    back = kv_quant.dequantize_kv(flat, k_scale, torch.float32)
    bound = _REL[kv_dtype] * (key[keep].abs() if kv_dtype != torch.int8 else key.abs().max())
    assert bool(((back - key[keep]).abs() <= bound + 1e-6).all())
    assert int(caches[0].view(n * b, h, d)[slots[3]].view(torch.uint8).count_nonzero()) == 0


def test_write_kv_refuses_a_quantized_cache_without_scales():
    cache = torch.zeros(2, 4, 2, 8, dtype=torch.int8)
    x = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="k_scale"):
        ops.write_kv(x, x, cache, cache.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match="not quantized"):
        f = torch.zeros(2, 4, 2, 8)
        ops.write_kv(x, x, f, f.clone(), torch.tensor([0]), torch.ones(2), torch.ones(2))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("ratio", [1, 4])
def test_attention_over_a_quantized_cache_matches_reference(kv_dtype, dtype, ratio):
    seed = ratio * 10 + KV_DTYPES.index(kv_dtype)
    q_lens, ctx_lens = random_lengths(seed, 5, max_ctx=120, max_new=24)
    batch, qb, ks, vs = quantized_case(seed, q_lens, ctx_lens, ratio, dtype, kv_dtype)
    args = qb.attention_args()
    got = ops.paged_attention(*args, k_scale=ks, v_scale=vs)
    want = kv_quant.paged_attention_quant_ref(*args, ks, vs)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)
    # And near the float cache's attention: quantization error only.
    exact = R.paged_attention_ref(*batch.attention_args()).float()
    drift = (got.float() - exact).abs().max().item()
    assert drift < (0.03 if kv_dtype == torch.int8 else 0.15), drift

    _, qd, ks, vs = quantized_case(seed, [1] * 4, [1, 17, 50, 119], ratio, dtype, kv_dtype)
    got = ops.paged_decode_attention(*qd.decode_args(), k_scale=ks, v_scale=vs)
    want = kv_quant.paged_attention_quant_ref(*qd.attention_args(), ks, vs)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)
