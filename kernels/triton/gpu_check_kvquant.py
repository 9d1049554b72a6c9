"""The int8 / float8 KV cache on a CUDA GPU: the quantizing KV write and both attention
kernels over a quantized cache against the torch references of ``pdserve.kernels.kv_quant``.
Part of ``python -m pdserve.kernels.triton.gpu_check``."""

from __future__ import annotations

import torch

from pdserve.kernels.triton.gpu_check import Row, _checked

__all__ = ["check_quantized_kv"]


def check_quantized_kv(dev: torch.device) -> list[Row]:
    from pdserve.kernels import kv_quant, ops
    from pdserve.kernels.testing import (
        ATTN_TOL,
        make_batch,
        max_abs_error,
        quantize_batch,
        random_lengths,
    )

    rows: list[Row] = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        kv_name = str(kv_dtype).removeprefix("torch.")
        # The write: the same elements as the reference, counted in quantization steps
        # (a division rounded differently may move one element by one step).
        t, h, d, n, b = 300, 8, 128, 64, 16
        key = torch.randn(t, h, d, device=dev, generator=gen, dtype=torch.bfloat16)
        value = torch.randn(t, h, d, device=dev, generator=gen, dtype=torch.bfloat16)
        scale = torch.linspace(0.005, 0.03, h, device=dev)
        slots = torch.randperm(n * b, device=dev, generator=gen)[:t]
        got = [torch.zeros(n, b, h, d, dtype=kv_dtype, device=dev) for _ in range(2)]
        want = [torch.zeros_like(c) for c in got]
        ops.write_kv(key, value, got[0], got[1], slots, scale, scale)
        kv_quant.write_kv_quant_ref(key, value, want[0], want[1], slots, scale, scale)
        steps = max(
            float((g.float() - w.float()).abs().max() / (1.0 if kv_dtype == torch.int8 else 32))
            for g, w in zip(got, want, strict=True)
        )
        rows.append(_checked("write_kv", f"T={t} H={h} D={d} bf16 -> {kv_name}", steps, 1.0))
        for dtype in (torch.bfloat16, torch.float32):
            label = f"S=12 g=4 D=128 B=16 {str(dtype).removeprefix('torch.')} {kv_name}"
            heads = {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 128}
            q_lens, ctx_lens = random_lengths(3, 12, max_ctx=3000, max_new=600)
            for kind, lens in (("mixed", q_lens), ("decode", [1] * 12)):
                batch = make_batch(
                    3, lens, ctx_lens, **heads, block_size=16, dtype=dtype, device=dev
                )
                qb, ks, vs = quantize_batch(batch, kv_dtype)
                expected = kv_quant.paged_attention_quant_ref(*qb.attention_args(), ks, vs)
                if kind == "decode":
                    out = ops.paged_decode_attention(*qb.decode_args(), k_scale=ks, v_scale=vs)
                else:
                    out = ops.paged_attention(*qb.attention_args(), k_scale=ks, v_scale=vs)
                err = max_abs_error(out, expected)
                op = "paged_decode_attention" if kind == "decode" else "paged_attention"
                rows.append(_checked(op, f"{kind} {label}", err, ATTN_TOL[dtype]))
    return rows
