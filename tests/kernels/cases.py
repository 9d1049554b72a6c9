"""Test helpers for the kernel tests; batch builders live in ``pdserve.kernels.testing``."""

from __future__ import annotations

import torch

from pdserve.kernels.testing import ATTN_TOL, PagedBatch, make_batch, max_abs_error, random_lengths

__all__ = [
    "ATTN_TOL",
    "ELEMENTWISE_TOL",
    "PagedBatch",
    "assert_close",
    "make_batch",
    "random_lengths",
]

# (atol, rtol) for elementwise kernels (norm, rotary); bfloat16 allows one rounding step.
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Max abs error check with a readable failure message."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    err = max_abs_error(actual, expected)
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g}"
