"""Test helpers for the kernel tests; batch builders live in ``pdserve.kernels.testing``."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.kernels.testing import (
    ATTN_TOL,
    PagedBatch,
    make_batch,
    max_abs_error,
    quantize_batch,
    random_lengths,
)

__all__ = [
    "ATTN_TOL",
    "ELEMENTWISE_TOL",
    "PagedBatch",
    "assert_close",
    "interpreter_or_skip",
    "make_batch",
    "quantized_case",
    "random_lengths",
]

# (atol, rtol) for elementwise kernels (norm, rotary); bfloat16 allows one rounding step.
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def interpreter_or_skip() -> None:
    """Skip a Triton kernel test unless it can run under the interpreter (on a CUDA machine
    gpu_verify covers the compiled kernels)."""
    from tests.kernels.conftest import TRITON_IMPORTED_TOO_EARLY

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA machine: gpu_verify covers the compiled kernel")
    if TRITON_IMPORTED_TOO_EARLY:
        pytest.skip("triton was imported before TRITON_INTERPRET was set")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Max abs error check with a readable failure message."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    err = max_abs_error(actual, expected)
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g}"


# Unit roundoff of float32 and bfloat16: the error bounds below are counted in them.
U32 = 2.0**-24
U16 = 2.0**-8


def rms_norm_bound(
    truth: torch.Tensor, hidden: int, out_dtype: torch.dtype, truncating: bool = False
) -> torch.Tensor:
    """|out - truth| allowed: the float32 sum of squares over ``hidden`` terms (relative
    error <= hidden * u32, so the 1/rms factor is off by <= hidden/2 * u32), the square root
    and the division (2 u32), the input sum (u32) and the two products (2 u32), then one
    rounding to ``out_dtype`` (``truncating``: Triton's interpreter converts to bf16 by
    truncation, a whole ulp, where compiled kernels round to nearest)."""
    f32 = (hidden / 2 + 5) * U32
    final = (2 if truncating else 1) * (U16 if out_dtype == torch.bfloat16 else U32)
    return (final + f32 * (1 + final)) * truth.abs()


def silu_bound(truth: torch.Tensor, truncating: bool = False) -> torch.Tensor:
    """exp to ~2^-23 (its polynomial, kernels/cpu/csrc/cpu_math.h) plus four float32
    roundings (1 + e, the division, g * sigmoid, * up): 6 u32, then one bf16 rounding
    (a whole ulp where ``truncating``, as for rms_norm_bound)."""
    final = (2 if truncating else 1) * U16
    return (final + 6 * U32 * (1 + final)) * truth.abs()


def quantized_case(
    seed: int,
    q_lens: list[int],
    ctx_lens: list[int],
    ratio: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> tuple[PagedBatch, PagedBatch, torch.Tensor, torch.Tensor]:
    """A batch over 2 KV heads (``ratio`` query heads each, head_dim 64, block size 16), and
    the same batch over its caches quantized to ``kv_dtype``, with the K and V scales."""
    batch = make_batch(
        seed, q_lens, ctx_lens, num_q_heads=2 * ratio, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=dtype,
    )  # fmt: skip
    return (batch, *quantize_batch(batch, kv_dtype))
