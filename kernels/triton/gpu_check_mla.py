"""DeepSeek-V3's multi-head latent attention on a CUDA GPU: the MLA decode and prefill
kernels against ``reference.paged_mla_decode_ref`` / ``paged_mla_prefill_ref`` (latent 512 +
rope 64; 128 heads and a partial head block; bf16, float32, an int8 latent; prefill over a
mixed batch of prompts, chunks after a cached prefix and decode tokens), the one-plane KV
write, and both timed against the generic kernels the engine used before (16 heads per
call). Part of ``python -m pdserve.kernels.triton.gpu_check``."""

from __future__ import annotations

import functools

import torch

from pdserve.kernels.testing import PagedBatch
from pdserve.kernels.triton.gpu_check import Ceilings, Row, _checked, _equal_error, _timed
from pdserve.kernels.triton.gpu_check import _bench as bench_ms

__all__ = ["check_mla"]

LATENT, ROPE = 512, 64


def _batch(
    seed: int,
    heads: int,
    ctx_lens: list[int],
    dtype: torch.dtype,
    dev: torch.device,
    q_lens: list[int] | None = None,  # new tokens per sequence; default one (decode)
) -> PagedBatch:
    from pdserve.kernels.testing import make_batch

    return make_batch(
        seed, q_lens or [1] * len(ctx_lens), ctx_lens, num_q_heads=heads, num_kv_heads=1,
        head_dim=LATENT + ROPE, block_size=16, dtype=dtype, device=dev,
    )  # fmt: skip


def _prefill_args(
    b: PagedBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int]:
    """Positional arguments of ``ops.paged_mla_prefill`` and its kernel."""
    return (b.q, b.k_cache, b.cu_seqlens_q, b.seq_lens, b.block_tables, b.scale, LATENT)


def _checks(dev: torch.device) -> list[Row]:
    from pdserve.kernels import kv_quant, ops
    from pdserve.kernels import reference as R
    from pdserve.kernels.testing import ATTN_TOL, max_abs_error, quantize_batch, random_lengths
    from pdserve.kernels.triton.mla_decode import paged_mla_decode_triton

    rows: list[Row] = []
    _, ctx_lens = random_lengths(11, 8, max_ctx=3000, max_new=1)
    for seed, (heads, dtype) in enumerate(
        [(128, torch.bfloat16), (20, torch.bfloat16), (128, torch.float32)]
    ):
        b = _batch(seed, heads, ctx_lens, dtype, dev)
        args = (b.q, b.k_cache, b.block_tables, b.seq_lens, b.scale, LATENT)
        want = R.paged_mla_decode_ref(*args)
        label = f"S=8 H={heads} L={LATENT}+{ROPE} {str(dtype).removeprefix('torch.')}"
        for splits in (None, 1, 5):
            err = max_abs_error(paged_mla_decode_triton(*args, num_splits=splits), want)
            rows.append(
                _checked("paged_mla_decode", f"{label} splits={splits or 'auto'}", err,
                         ATTN_TOL[dtype])
            )  # fmt: skip
    qb, scale, _ = quantize_batch(_batch(9, 128, ctx_lens, torch.bfloat16, dev), torch.int8)
    plain = kv_quant.dequantize_kv(qb.k_cache, scale, torch.bfloat16)
    want = R.paged_mla_decode_ref(qb.q, plain, qb.block_tables, qb.seq_lens, qb.scale, LATENT)
    got = ops.paged_mla_decode(
        qb.q, qb.k_cache, qb.block_tables, qb.seq_lens, qb.scale, LATENT, scale
    )
    rows.append(_checked("paged_mla_decode", "int8 latent H=128", max_abs_error(got, want),
                         ATTN_TOL[torch.bfloat16]))  # fmt: skip
    # The one-plane write: the latent lands once, at its slots.
    cache = torch.zeros(64, 16, 1, LATENT + ROPE, dtype=torch.bfloat16, device=dev)
    want_cache = cache.clone()
    key = torch.randn(300, 1, LATENT + ROPE, dtype=torch.bfloat16, device=dev)
    slots = torch.randperm(64 * 16, device=dev)[:300]
    ops.write_kv(key, None, cache, None, slots)
    R.write_kv_ref(key, None, want_cache, None, slots)
    rows.append(_checked("write_kv one plane", "T=300 576 bf16",
                         _equal_error(torch.equal(cache, want_cache)), 0.0))  # fmt: skip
    return rows + _prefill_checks(dev)


def _prefill_checks(dev: torch.device) -> list[Row]:
    from pdserve.kernels import kv_quant, ops
    from pdserve.kernels import reference as R
    from pdserve.kernels.testing import ATTN_TOL, max_abs_error, quantize_batch, random_lengths
    from pdserve.kernels.triton.mla_prefill import paged_mla_prefill_triton

    rows: list[Row] = []
    # Decode tokens, and chunks of up to 600 tokens after cached prefixes (some none).
    q_lens, ctx_lens = random_lengths(12, 8, max_ctx=3000, max_new=600)
    for seed, (heads, dtype) in enumerate(
        [(128, torch.bfloat16), (20, torch.bfloat16), (128, torch.float32)]
    ):
        b = _batch(20 + seed, heads, ctx_lens, dtype, dev, q_lens)
        want = R.paged_mla_prefill_ref(*_prefill_args(b))
        dt = str(dtype).removeprefix("torch.")
        label = f"T={sum(q_lens)} S={len(q_lens)} H={heads} L={LATENT}+{ROPE} {dt}"
        for tile in (None, (32, 1, 8), (16, 2, 8)):
            err = max_abs_error(paged_mla_prefill_triton(*_prefill_args(b), tile=tile), want)
            name = f"{label} tile={tile or 'auto'}"
            rows.append(_checked("paged_mla_prefill", name, err, ATTN_TOL[dtype]))
    qb, scale, _ = quantize_batch(
        _batch(29, 128, ctx_lens, torch.bfloat16, dev, q_lens), torch.int8
    )
    plain = kv_quant.dequantize_kv(qb.k_cache, scale, torch.bfloat16)
    want = R.paged_mla_prefill_ref(qb.q, plain, *_prefill_args(qb)[2:])
    got = ops.paged_mla_prefill(*_prefill_args(qb), scale)
    rows.append(_checked("paged_mla_prefill", "int8 latent H=128", max_abs_error(got, want),
                         ATTN_TOL[torch.bfloat16]))  # fmt: skip
    return rows


def _prefill_timings(dev: torch.device, quick: bool, ceil: Ceilings) -> list[Row]:
    """A whole prompt, and chunks after a cached prefix, at 128 heads: the MLA prefill kernel
    at several tiles against the generic prefill kernel 16 heads per call (the previous path)."""
    from pdserve.kernels import ops
    from pdserve.kernels.triton.mla_prefill import paged_mla_prefill_triton

    total, heads = (1024 if quick else 4096), 128
    rows = []
    for label, q_lens, ctx_lens in [
        ("prompt", [total], [total]),
        ("chunked", [total // 4] * 4, [total // 2] * 4),
    ]:
        b = _batch(4321, heads, ctx_lens, torch.bfloat16, dev, q_lens)
        pairs = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(q_lens, ctx_lens, strict=True))
        # Per visible (query, slot) pair and head: 576-wide scores, 512-wide values.
        flop = 2 * pairs * heads * (2 * LATENT + ROPE)
        shape = f"{label} T={sum(q_lens)} ctx={ctx_lens[0]} H={heads} L={LATENT}+{ROPE} bf16"
        for tile in ((64, 1, 8), (32, 1, 8), (32, 2, 8), (16, 4, 8)):
            ms = bench_ms(functools.partial(paged_mla_prefill_triton, *_prefill_args(b), tile=tile))
            rows.append(_timed(f"paged_mla_prefill tile={tile}", shape, None, None, ms, "TFLOP/s",
                               flop / ms / 1e9, ceil.matmul_tflops))  # fmt: skip

        def generic(b: PagedBatch = b) -> None:  # 16 heads per call, 576-wide output
            for h in range(0, heads, 16):
                q = b.q[:, h : h + 16].contiguous()
                ops.paged_attention(q, b.k_cache, b.k_cache, b.cu_seqlens_q, b.seq_lens,
                                    b.block_tables, b.scale)  # fmt: skip

        ms = bench_ms(generic)
        rows.append(_timed("prefill, 16 heads/call (previous)", shape, None, None, ms, "TFLOP/s",
                           flop / ms / 1e9, ceil.matmul_tflops))  # fmt: skip
    return rows


def _timings(dev: torch.device, quick: bool, ceil: Ceilings) -> list[Row]:
    from pdserve.kernels import ops
    from pdserve.kernels.triton.mla_decode import paged_mla_decode_triton

    num_seqs, ctx, heads = (16, 1024, 128) if quick else (64, 4096, 128)
    b = _batch(1234, heads, [ctx] * num_seqs, torch.bfloat16, dev)
    args = (b.q, b.k_cache, b.block_tables, b.seq_lens, b.scale, LATENT)
    # The latent read once per sequence; the query and the output.
    moved = num_seqs * ctx * (LATENT + ROPE) * 2 + b.q.numel() * 2 + num_seqs * heads * LATENT * 2
    shape = f"S={num_seqs} ctx={ctx} H={heads} L={LATENT}+{ROPE} bf16"
    rows = []
    for block_h, warps in ((16, 4), (32, 4), (32, 8), (64, 8)):
        run = functools.partial(paged_mla_decode_triton, *args, block_h=block_h, num_warps=warps)
        ms = bench_ms(run)
        rows.append(_timed(f"paged_mla_decode block_h={block_h} warps={warps}", shape, None,
                           None, ms, "GB/s", moved / ms / 1e6, ceil.copy_gbs))  # fmt: skip

    def generic() -> None:  # the previous CUDA path: 16 heads per MQA call, 576-wide output
        for h in range(0, heads, 16):
            q = b.q[:, h : h + 16].contiguous()
            ops.paged_decode_attention(q, b.k_cache, b.k_cache, b.block_tables, b.seq_lens, b.scale)

    ms = bench_ms(generic)
    rows.append(_timed("MQA decode, 16 heads/call (previous)", shape, None, None, ms, "GB/s",
                       moved / ms / 1e6, ceil.copy_gbs))  # fmt: skip
    return rows


def check_mla(dev: torch.device, quick: bool, ceil: Ceilings) -> list[Row]:
    """The checks and the timings."""
    return _checks(dev) + _timings(dev, quick, ceil) + _prefill_timings(dev, quick, ceil)
