"""No JIT while serving: the decode kernel's split count (a compile-time constant) comes
from a handful of buckets whatever the batch and context, the bucketed heuristic still
matches the reference (trailing splits are empty), and compilations can be counted."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from pdserve.kernels.triton import decode  # noqa: E402
from pdserve.kernels.triton.jit_count import CompileCounter  # noqa: E402


def test_the_heuristic_only_picks_bucketed_split_counts() -> None:
    seen = set()
    for seqs in (1, 2, 3, 5, 8, 13, 32, 100, 256):
        for ctx in (16, 100, 257, 1000, 4097, 33000, 131072):
            splits, _ = decode._choose_splits(seqs, 8, ctx, torch.device("cpu"))
            seen.add(splits)
    assert seen <= set(decode.SPLIT_BUCKETS)
    assert [decode.bucket_splits(n) for n in (1, 3, 5, 17, 64, 99)] == [1, 4, 8, 32, 64, 64]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_a_bucket_wider_than_the_context_needs_matches_the_reference(monkeypatch) -> None:
    from pdserve.kernels import reference as R
    from tests.kernels.cases import ATTN_TOL, assert_close, make_batch

    # 3 splits wanted -> bucket 4: the 4th split of the longest sequence may be empty.
    monkeypatch.setattr(decode, "_choose_splits", lambda *a: (decode.bucket_splits(3), 64))
    batch = make_batch(3, [1, 1], [520, 40], num_q_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype=torch.float32)  # fmt: skip
    args = batch.decode_args()
    got = decode.paged_decode_attention_triton(*args)
    assert_close(got, R.paged_decode_attention_ref(*args), ATTN_TOL[torch.float32])


def test_compile_counter_counts_misses_and_keeps_a_chained_hook() -> None:
    from triton import knobs

    chained: list[str] = []

    def previous(*, fn, **kwargs) -> bool:
        chained.append(fn.name)
        return False

    fn = type("Info", (), {"name": "_decode_split_kernel"})()
    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = previous
    try:
        with CompileCounter() as counter:
            # Triton calls the hook on each in-memory cache miss; False = go on compiling.
            assert knobs.runtime.jit_cache_hook(fn=fn, key=1) is False
            knobs.runtime.jit_cache_hook(fn=fn, key=2)
        assert counter.total == 2 and counter.by_kernel["_decode_split_kernel"] == 2
        assert chained == ["_decode_split_kernel"] * 2
        assert knobs.runtime.jit_cache_hook is previous
    finally:
        knobs.runtime.jit_cache_hook = old


def test_warm_up_compiles_nothing_on_a_cpu(tiny_model_dir) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), device="cpu"))
    assert runner.warm_up() == 0
