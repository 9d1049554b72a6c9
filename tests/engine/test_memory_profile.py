"""The profiling step that sizes a GPU's KV pool: the largest batch the scheduler may hand
the runner, run on dummy tokens against a throwaway pool (here on the CPU; on CUDA the
runner measures the allocator's peak around the same call)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import memory_profile
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner


@pytest.mark.parametrize(
    ("tokens", "seqs", "max_len", "expect_seqs"),
    [(2048, 64, 4096, 64), (100, 64, 4096, 64), (10, 64, 4096, 10), (2048, 2, 512, 2)],
)
def test_profile_batch_is_the_largest_step(tokens, seqs, max_len, expect_seqs) -> None:
    step, blocks = memory_profile.profile_batch(tokens, seqs, max_len, 16)
    assert len(step.chunks) == expect_seqs
    assert all(c.sample for c in step.chunks)
    assert step.num_batched_tokens == min(tokens, expect_seqs * max_len)
    assert max(c.num_tokens for c in step.chunks) <= max_len
    assert blocks == sum(len(c.block_ids) for c in step.chunks)
    ids = [b for c in step.chunks for b in c.block_ids]
    assert sorted(ids) == list(range(blocks))  # no two requests share a block


def test_profile_step_runs_the_model_and_restores_the_pool(tiny_model_dir: Path) -> None:
    config = EngineConfig(
        model=str(tiny_model_dir), block_size=16, max_num_seqs=8, max_num_batched_tokens=96
    )
    runner = ModelRunner(config)
    pool = runner.allocate_kv_cache(4)
    calls: list[int] = []
    real = runner.compute_logits

    def spy(out):
        calls.append(out.num_batched_tokens)
        batch, logits = real(out)
        assert logits.shape == (8, runner.model_config.vocab_size)
        return batch, logits

    runner.compute_logits = spy  # type: ignore[method-assign]
    blocks = memory_profile.run_profile_step(runner)
    assert calls == [96] and blocks == 8
    assert runner.kv_cache is pool and torch.equal(pool, torch.zeros_like(pool))
