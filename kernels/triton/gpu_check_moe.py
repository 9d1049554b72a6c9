"""The fused-MoE rows of ``pdserve.kernels.triton.gpu_check``: the Triton kernel against the
per-expert reference on the GPU, then timed on a Qwen3-30B-A3B-shaped layer (128 experts,
top-8, hidden 2048, expert intermediate 768, bf16) at a decode-sized and a prefill-sized
step. Decode is reported as the bytes of the experts it touched per second (against the
copy ceiling), prefill as useful TFLOP/s (against the matmul ceiling). A last row checks
gpt-oss's variant (expert biases and the clamped SwiGLU) against the reference on the same
layer shape."""

from __future__ import annotations

import functools

import torch

from pdserve.kernels.triton.gpu_check import Ceilings, Row, _bench, _rel_error, _timed

__all__ = ["bench_moe"]

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def _problem(
    tokens: int, dev: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, HIDDEN, device=dev, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, generator=gen) / 45).to(
        torch.bfloat16
    )
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device=dev, generator=gen) / 28).to(torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, device=dev, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
    return x, w13, w2, weights, ids


def bench_moe(dev: torch.device, quick: bool, ceil: Ceilings) -> list[Row]:
    from pdserve.kernels.moe_ops import fused_moe
    from pdserve.kernels.moe_reference import fused_moe_ref

    gen = torch.Generator(device=dev).manual_seed(2)
    rows = []
    for tokens in (16, 1024 if quick else 4096):
        x, w13, w2, weights, ids = _problem(tokens, dev, gen)
        err = _rel_error(
            fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids)
        )
        ms = _bench(functools.partial(fused_moe, x, w13, w2, weights, ids))
        shape = f"T={tokens} E={EXPERTS} top{TOP_K} H={HIDDEN} I={INTER} bf16"
        if tokens <= 64:
            hit = ids.unique().numel()
            gbs = hit * 3 * HIDDEN * INTER * 2 / ms / 1e6
            rows.append(
                _timed(
                    "fused_moe decode (rel. err)", shape, err, 2e-2, ms, "GB/s", gbs, ceil.copy_gbs
                )
            )
        else:
            tflops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER / ms / 1e9
            rows.append(
                _timed(
                    "fused_moe prefill (rel. err)",
                    shape,
                    err,
                    2e-2,
                    ms,
                    "TFLOP/s",
                    tflops,
                    ceil.matmul_tflops,
                )
            )
        del x, w13, w2
        torch.cuda.empty_cache()
    rows.append(_gpt_oss_row(dev, gen))
    return rows


def _gpt_oss_row(dev: torch.device, gen: torch.Generator) -> Row:
    from pdserve.kernels.moe_ops import ClampedSwiGLU, fused_moe
    from pdserve.kernels.moe_reference import fused_moe_ref

    x, w13, w2, weights, ids = _problem(256, dev, gen)
    b13 = torch.randn(EXPERTS, 2 * INTER, device=dev, generator=gen).to(torch.bfloat16)
    b2 = torch.randn(EXPERTS, HIDDEN, device=dev, generator=gen).to(torch.bfloat16)
    args = (x, w13 * 4, w2, weights, ids, b13, b2, ClampedSwiGLU())  # the clamps bite
    err = _rel_error(fused_moe(*args), fused_moe_ref(*args))
    shape = f"T=256 E={EXPERTS} top{TOP_K} H={HIDDEN} I={INTER} bf16, biases"
    return Row("fused_moe gpt-oss swiglu (rel. err)", shape, err, 2e-2, None, "", None, None)
