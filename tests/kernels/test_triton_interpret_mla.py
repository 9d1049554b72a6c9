"""The Triton MLA decode kernel, run by Triton's interpreter, against its torch reference
(``reference.paged_mla_decode_ref``): head counts that fill and that do not fill a head
block, contexts from 1 token to several splits, float32 / bf16 and an int8 / float8 latent
cache; and the CPU dispatch (``ops.paged_mla_decode``), which keeps the MQA path.

Small widths (latent 32 + rope 16) keep the interpreter fast; the kernel is the one the
engine runs for DeepSeek-V3's 512 + 64 (compiled for sm_90 in ``aot_compile``).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import kv_quant, ops
from pdserve.kernels import reference as R
from pdserve.kernels.testing import ATTN_TOL, make_batch, max_abs_error, quantize_batch
from tests.kernels.cases import interpreter_or_skip

LATENT, ROPE = 32, 16
CONTEXTS = [1, 17, 130, 300]


def _case(seed: int, heads: int, dtype: torch.dtype, block_size: int = 16):  # type: ignore[no-untyped-def]
    return make_batch(
        seed, [1] * len(CONTEXTS), CONTEXTS, num_q_heads=heads, num_kv_heads=1,
        head_dim=LATENT + ROPE, block_size=block_size, dtype=dtype,
    )  # fmt: skip


def _args(batch):  # type: ignore[no-untyped-def]
    return batch.q, batch.k_cache, batch.block_tables, batch.seq_lens, batch.scale, LATENT


def test_cpu_dispatch_matches_reference() -> None:
    batch = _case(0, 20, torch.float32)
    got = ops.paged_mla_decode(*_args(batch))
    assert got.shape == (len(CONTEXTS), 20, LATENT)
    assert max_abs_error(got, R.paged_mla_decode_ref(*_args(batch))) <= ATTN_TOL[torch.float32]


def test_reference_is_the_expanded_attention() -> None:
    """What the absorbed form stands for: per head, softmax(q . slot) over the context
    weighting the latent part of each slot (written out without the paged helpers)."""
    batch = _case(1, 4, torch.float32)
    want = R.paged_mla_decode_ref(*_args(batch))
    for s, ctx in enumerate(CONTEXTS):
        table = batch.block_tables[s]
        slots = torch.cat([batch.k_cache[int(b)] for b in table[: -(-ctx // 16)]])[:ctx, 0]
        probs = torch.softmax(batch.q[s] @ slots.T * batch.scale, dim=-1)  # [H, ctx]
        assert torch.allclose(want[s], probs @ slots[:, :LATENT], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [16, 20])
def test_kernel_matches_reference(heads: int, dtype: torch.dtype) -> None:
    interpreter_or_skip()
    from pdserve.kernels.triton.mla_decode import paged_mla_decode_triton

    batch = _case(heads, heads, dtype, block_size=16 if dtype == torch.float32 else 32)
    want = R.paged_mla_decode_ref(*_args(batch))
    for splits in (None, 1, 3):
        got = paged_mla_decode_triton(*_args(batch), num_splits=splits)
        assert got.shape == want.shape and got.dtype == dtype
        assert max_abs_error(got, want) <= ATTN_TOL[dtype], f"splits={splits}"


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_kernel_over_a_quantized_latent_matches_reference(kv_dtype: torch.dtype) -> None:
    interpreter_or_skip()
    from pdserve.kernels.triton.mla_decode import paged_mla_decode_triton

    batch, scale, _ = quantize_batch(_case(7, 16, torch.float32), kv_dtype)
    plain = kv_quant.dequantize_kv(batch.k_cache, scale, torch.float32)
    want = R.paged_mla_decode_ref(batch.q, plain, *_args(batch)[2:])
    for splits in (1, 3):
        got = paged_mla_decode_triton(*_args(batch), kv_scale=scale, num_splits=splits)
        assert max_abs_error(got, want) <= ATTN_TOL[torch.float32], f"splits={splits}"
