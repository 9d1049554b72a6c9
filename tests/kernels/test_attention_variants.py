"""Sliding window, logit softcap and attention sinks: the reference against a naive
float64 softmax, and the CPU path and the Triton kernels (interpreter) against the
reference, over mixed prefill/decode batches, GQA ratios and block sizes."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch

from pdserve.kernels import ops
from pdserve.kernels import reference as R
from tests.kernels.cases import ATTN_TOL, assert_close, make_batch

# (sliding_window, softcap, sinks)
VARIANTS = {
    "window": (7, None, False),
    "softcap": (None, 2.0, False),
    "sinks": (None, None, True),
    "all": (20, 5.0, True),
}


def _batch(seed: int, ratio: int, block_size: int, dtype: torch.dtype, decode: bool = False):  # type: ignore[no-untyped-def]
    q_lens, ctx_lens = (
        ([1, 1, 1], [3, 40, 77]) if decode else ([1, 9, 1, 17, 30], [5, 9, 40, 33, 30])
    )
    return make_batch(
        seed=seed,
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        num_q_heads=2 * ratio,
        num_kv_heads=2,
        head_dim=16,
        block_size=block_size,
        dtype=dtype,
    )


def _variant(name: str, num_heads: int) -> tuple[int | None, float | None, torch.Tensor | None]:
    window, cap, has_sinks = VARIANTS[name]
    sinks = torch.linspace(-1.0, 2.0, num_heads) if has_sinks else None
    return window, cap, sinks


def _naive(batch, window, cap, sinks) -> torch.Tensor:  # type: ignore[no-untyped-def]
    q, kc, vc = batch.q.double(), batch.k_cache.double(), batch.v_cache.double()
    bs, group = kc.shape[1], q.shape[1] // kc.shape[2]
    out = torch.zeros_like(q)
    cu = batch.cu_seqlens_q.tolist()
    for s, ctx in enumerate(batch.seq_lens.tolist()):
        table = batch.block_tables[s].tolist()
        q_len = cu[s + 1] - cu[s]
        for j in range(q_len):
            pos = ctx - q_len + j
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(q.shape[1]):
                keys = range(first, pos + 1)
                logits = []
                for p in keys:
                    x = (
                        float(q[cu[s] + j, h] @ kc[table[p // bs], p % bs, h // group])
                        * batch.scale
                    )
                    logits.append(cap * math.tanh(x / cap) if cap else x)
                top = max(logits + ([float(sinks[h])] if sinks is not None else []))
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights) + (math.exp(float(sinks[h]) - top) if sinks is not None else 0)
                for p, w in zip(keys, weights, strict=True):
                    out[cu[s] + j, h] += w / total * vc[table[p // bs], p % bs, h // group]
    return out.to(batch.q.dtype)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_reference_matches_naive_softmax(name: str) -> None:
    batch = _batch(1, 4, 16, torch.float32)
    window, cap, sinks = _variant(name, batch.q.shape[1])
    got = R.paged_attention_ref(*batch.attention_args(), window, cap, sinks)
    assert_close(got, _naive(batch, window, cap, sinks), 1e-5)


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize(("ratio", "block_size"), [(1, 16), (4, 8)])
def test_cpu_path_matches_reference(name: str, ratio: int, block_size: int) -> None:
    for decode in (False, True):
        batch = _batch(ratio + block_size, ratio, block_size, torch.float32, decode)
        window, cap, sinks = _variant(name, batch.q.shape[1])
        want = R.paged_attention_ref(*batch.attention_args(), window, cap, sinks)
        got = ops.paged_attention(*batch.attention_args(), window, cap, sinks)
        assert_close(got, want, ATTN_TOL[torch.float32])
        if decode:
            got = ops.paged_decode_attention(*batch.decode_args(), window, cap, sinks)
            assert_close(got, want, ATTN_TOL[torch.float32])


def test_a_window_changes_the_output() -> None:
    """The windowed batch attends less than the full one (the test above could not pass
    with the window ignored)."""
    batch = _batch(5, 2, 16, torch.float32)
    full = ops.paged_attention(*batch.attention_args())
    windowed = ops.paged_attention(*batch.attention_args(), 7)
    assert not torch.allclose(full, windowed)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter runs only")
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_reference(name: str, dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    from pdserve.kernels.triton.decode import paged_decode_attention_triton
    from pdserve.kernels.triton.prefill import paged_attention_triton

    for decode in (False, True):
        batch = _batch(11, 4, 16, dtype, decode)
        window, cap, sinks = _variant(name, batch.q.shape[1])
        want = R.paged_attention_ref(*batch.attention_args(), window, cap, sinks)
        got = paged_attention_triton(
            *batch.attention_args(), block_m=16, sliding_window=window, softcap=cap, sinks=sinks
        )
        assert_close(got, want, ATTN_TOL[dtype])
        if decode:
            got = paged_decode_attention_triton(
                *batch.decode_args(), sliding_window=window, softcap=cap, sinks=sinks
            )
            assert_close(got, want, ATTN_TOL[dtype])


def _freed_outside_window(batch, window: int, poison: float = float("nan")):  # type: ignore[no-untyped-def]
    """The batch as a window pool holds it: every block wholly older than the window of a
    sequence's first query points at a zero null block (appended), and the blocks it held
    before are poisoned with NaN (freed, whatever another sequence writes there; an int8
    cache, which has no NaN, with ``poison``)."""
    bs = batch.k_cache.shape[1]
    null = batch.k_cache.shape[0]
    k = torch.cat([batch.k_cache, torch.zeros_like(batch.k_cache[:1])])
    v = torch.cat([batch.v_cache, torch.zeros_like(batch.v_cache[:1])])
    tables = batch.block_tables.clone()
    cu = batch.cu_seqlens_q.tolist()
    freed = 0
    for s, ctx in enumerate(batch.seq_lens.tolist()):
        first_query = ctx - (cu[s + 1] - cu[s])
        for j in range(max(0, first_query - window + 1) // bs):
            k[tables[s, j]] = v[tables[s, j]] = poison
            tables[s, j] = null
            freed += 1
    assert freed > 0, "the batch was meant to have blocks outside the window"
    return replace(batch, k_cache=k, v_cache=v, block_tables=tables)


@pytest.mark.parametrize("decode", [False, True])
def test_blocks_outside_the_window_are_never_read(decode: bool) -> None:
    """Window layers' freed blocks (engine/window_kv.py): the CPU path, and the Triton
    kernels under the interpreter, give the full table's output from a table whose
    out-of-window entries point at a zero null block, the freed blocks holding NaN."""
    batch = _batch(13, 2, 8, torch.float32, decode)
    window = 7
    want = R.paged_attention_ref(*batch.attention_args(), window)
    nulled = _freed_outside_window(batch, window)
    assert_close(ops.paged_attention(*nulled.attention_args(), window), want, 2e-5)
    if decode:
        got = ops.paged_decode_attention(*nulled.decode_args(), window)
        assert_close(got, want, 2e-5)
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    pytest.importorskip("triton")
    from pdserve.kernels.triton.decode import paged_decode_attention_triton
    from pdserve.kernels.triton.prefill import paged_attention_triton

    got = paged_attention_triton(*nulled.attention_args(), block_m=16, sliding_window=window)
    assert_close(got, want, 2e-5)
    if decode:
        got = paged_decode_attention_triton(*nulled.decode_args(), sliding_window=window)
        assert_close(got, want, 2e-5)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("decode", [False, True])
def test_quantized_blocks_outside_the_window_are_never_read(decode: bool, kv_dtype) -> None:  # type: ignore[no-untyped-def]
    """The same over an int8 / float8 window pool (its layer's scales): the CPU path, and
    the Triton kernels under the interpreter, give the full table's output, the freed
    blocks holding NaN (float8) or the type's largest value (int8)."""
    from pdserve.kernels import kv_quant
    from pdserve.kernels.testing import quantize_batch

    batch, ks, vs = quantize_batch(_batch(17, 2, 8, torch.float32, decode), kv_dtype)
    window = 7
    k = kv_quant.dequantize_kv(batch.k_cache, ks, torch.float32)
    v = kv_quant.dequantize_kv(batch.v_cache, vs, torch.float32)
    a = batch.attention_args()
    want = R.paged_attention_ref(a[0], k, v, *a[3:], window)
    poison = 127.0 if kv_dtype == torch.int8 else float("nan")
    nulled = _freed_outside_window(batch, window, poison)
    scales = {"k_scale": ks, "v_scale": vs}
    got = ops.paged_attention(*nulled.attention_args(), window, **scales)
    assert_close(got, want, 2e-5)
    if decode:
        got = ops.paged_decode_attention(*nulled.decode_args(), window, **scales)
        assert_close(got, want, 2e-5)
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    pytest.importorskip("triton")
    from pdserve.kernels.triton.decode import paged_decode_attention_triton
    from pdserve.kernels.triton.prefill import paged_attention_triton

    args = nulled.attention_args()
    got = paged_attention_triton(*args, block_m=16, sliding_window=window, **scales)
    assert_close(got, want, 2e-5)
    if decode:
        got = paged_decode_attention_triton(*nulled.decode_args(), sliding_window=window, **scales)
        assert_close(got, want, 2e-5)
