"""The Triton fused MoE, run by Triton's interpreter, against the per-expert reference."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.conftest import TRITON_IMPORTED_TOO_EARLY
from tests.kernels.moe_cases import assert_moe_close, make_moe_problem

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA machine: gpu_check covers the compiled kernel", allow_module_level=True)
if TRITON_IMPORTED_TOO_EARLY:
    pytest.skip("triton was imported before TRITON_INTERPRET was set", allow_module_level=True)

from pdserve.kernels.moe_reference import fused_moe_ref  # noqa: E402
from pdserve.kernels.triton.moe import align_by_expert, fused_moe_triton  # noqa: E402

# (tokens, hidden, intermediate, experts, top_k): odd sizes that leave partial row, column
# and K tiles; more experts than tokens (most blocks unused) and the reverse.
SHAPES = [(1, 64, 32, 8, 2), (9, 40, 24, 16, 4), (37, 72, 48, 4, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("skew", [False, True])
def test_triton_fused_moe_matches_reference(shape, dtype, skew) -> None:
    t, h, i, e, k = shape
    p = make_moe_problem(t, h, i, e, k, dtype, seed=sum(shape), skew=skew)
    assert_moe_close(fused_moe_triton(*p.args()), fused_moe_ref(*p.args()), dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_fused_moe_with_biases_and_clamped_swiglu_matches_reference(shape, dtype) -> None:
    t, h, i, e, k = shape
    p = make_moe_problem(t, h, i, e, k, dtype, seed=sum(shape), gpt_oss=True)
    got = fused_moe_triton(*p.args(), **p.extras())
    assert_moe_close(got, fused_moe_ref(*p.args(), **p.extras()), dtype)


def test_align_by_expert_groups_every_pair_once_in_whole_blocks() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]])
    sorted_ids, block_expert = align_by_expert(ids, num_experts=5, block_m=2)
    pairs = ids.numel()
    rows = sorted_ids.view(-1, 2)
    seen = []
    for block, expert in zip(rows.tolist(), block_expert.tolist(), strict=True):
        real = [p for p in block if p < pairs]
        if expert < 0:
            assert not real
            continue
        assert real and all(ids.flatten()[p].item() == expert for p in real)
        seen += real
    assert sorted(seen) == list(range(pairs))
    # Experts in order, each pair in its original order (stable): 0 -> pairs 1, 4.
    assert sorted_ids[:2].tolist() == [1, 4]
