"""The Triton MLA prefill kernel, run by Triton's interpreter, against its torch reference
(``reference.paged_mla_prefill_ref``): whole prompts, chunks after a cached prefix that
crosses block boundaries and single decode tokens in one varlen batch; head counts that fill
and that do not fill a head block; float32 / bf16 and an int8 / float8 latent cache; and the
CPU dispatch (``ops.paged_mla_prefill``), which keeps the generic prefill path.

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
# (new tokens, context incl. them): a whole prompt, chunks after a cached prefix (ending
# mid-block and on a block edge), a decode token, a one-token prompt.
Q_LENS = [19, 21, 1, 12, 1]
CTX_LENS = [19, 70, 90, 64, 1]


def _case(seed: int, heads: int, dtype: torch.dtype, block_size: int = 16):  # type: ignore[no-untyped-def]
    return make_batch(
        seed, Q_LENS, CTX_LENS, num_q_heads=heads, num_kv_heads=1, head_dim=LATENT + ROPE,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip


def _args(batch):  # type: ignore[no-untyped-def]
    return (batch.q, batch.k_cache, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables,
            batch.scale, LATENT)  # fmt: skip


def test_cpu_dispatch_matches_reference() -> None:
    batch = _case(0, 20, torch.float32)
    got = ops.paged_mla_prefill(*_args(batch))
    assert got.shape == (sum(Q_LENS), 20, LATENT)
    assert max_abs_error(got, R.paged_mla_prefill_ref(*_args(batch))) <= ATTN_TOL[torch.float32]


def test_reference_is_causal_attention_over_the_slots() -> None:
    """What the reference stands for, written out without the paged helpers: token j of a
    chunk sits at ``prefix + j`` and weights the latent of every slot up to it."""
    batch = _case(1, 4, torch.float32)
    want = R.paged_mla_prefill_ref(*_args(batch))
    cu = batch.cu_seqlens_q.tolist()
    for s, ctx in enumerate(CTX_LENS):
        table = batch.block_tables[s]
        slots = torch.cat([batch.k_cache[int(b)] for b in table[: -(-ctx // 16)]])[:ctx, 0]
        for j, row in enumerate(range(cu[s], cu[s + 1])):
            seen = slots[: ctx - Q_LENS[s] + j + 1]
            probs = torch.softmax(batch.q[row] @ seen.T * batch.scale, dim=-1)  # [H, pos + 1]
            assert torch.allclose(want[row], probs @ seen[:, :LATENT], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [16, 20])
def test_kernel_matches_reference(heads: int, dtype: torch.dtype) -> None:
    interpreter_or_skip()
    from pdserve.kernels.triton.mla_prefill import paged_mla_prefill_triton, tile_config

    batch = _case(heads, heads, dtype, block_size=16 if dtype == torch.float32 else 32)
    want = R.paged_mla_prefill_ref(*_args(batch))
    # The interpreter's default (16 heads x 4 tokens), the GPU's at 20 heads (32 x 2) and at
    # DeepSeek-V3's 128 heads (bf16: 64 x 1, one token per program; float32: 32 x 1).
    v3_tile = tile_config(128, dtype, torch.device("cuda"))
    for tile in (None, (32, 2, 8), v3_tile):
        got = paged_mla_prefill_triton(*_args(batch), tile=tile)
        assert got.shape == want.shape and got.dtype == dtype
        assert max_abs_error(got, want) <= ATTN_TOL[dtype], f"tile={tile}"


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_kernel_over_a_quantized_latent_matches_reference(kv_dtype: torch.dtype) -> None:
    interpreter_or_skip()
    from pdserve.kernels.triton.mla_prefill import paged_mla_prefill_triton

    batch, scale, _ = quantize_batch(_case(7, 16, torch.float32), kv_dtype)
    plain = kv_quant.dequantize_kv(batch.k_cache, scale, torch.float32)
    want = R.paged_mla_prefill_ref(batch.q, plain, *_args(batch)[2:])
    got = paged_mla_prefill_triton(*_args(batch), kv_scale=scale)
    assert max_abs_error(got, want) <= ATTN_TOL[torch.float32]


def test_dispatch_refuses_a_cache_that_is_not_one_latent_head() -> None:
    batch = make_batch(
        2, Q_LENS, CTX_LENS, num_q_heads=4, num_kv_heads=2, head_dim=LATENT + ROPE,
        block_size=16, dtype=torch.float32,
    )  # fmt: skip
    with pytest.raises(ValueError, match="one latent head"):
        ops.paged_mla_prefill(*_args(batch))
