"""Decode CUDA graphs, the parts a CPU can check: the batch buckets, the persistent
buffers a replay reads (a batch padded to its bucket, the block table to the full width)
giving the eager step's logits on both model paths, and the eager fallback of a
transformers model whose code cannot be captured. Capture itself needs CUDA
(``bench.gpu_verify``); here a "graph" replays the same forward eagerly over the same
buffers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import (
    DecodeGraphs,
    batch_buckets,
    bucket_for,
    capture_decode_graphs,
)
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput


def test_buckets_cover_every_batch_size_up_to_max_num_seqs() -> None:
    assert batch_buckets(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    buckets = batch_buckets(100)
    for n in range(1, 101):
        b = bucket_for(n, buckets)
        assert b is not None and b >= n and (b - n < 16)
    assert bucket_for(101, buckets) is None


class _EagerReplay:
    """Stands in for a captured graph: the same forward over the same persistent buffers."""

    def __init__(self, graphs: DecodeGraphs, b: int) -> None:
        self.graphs, self.b, self.replays = graphs, b, 0

    def replay(self) -> None:
        self.replays += 1
        self.graphs.logits[self.b].copy_(self.graphs._forward(self.b))


def _runner(model_dir: Path, impl: str) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            model=str(model_dir), device="cpu", block_size=16, max_num_seqs=8, model_impl=impl
        )
    )


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_a_padded_replay_gives_the_eager_logits(tiny_model_dir: Path, impl: str) -> None:
    runner = _runner(tiny_model_dir, impl)
    runner.allocate_kv_cache(32)
    greedy = SamplingParams(temperature=0.0)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40)), [3]]
    tables = [[0], [1, 2], [3]]
    chunks = [ScheduledChunk(f"r{i}", p, 0, tables[i], True, greedy, 0)
              for i, p in enumerate(prompts)]  # fmt: skip
    runner.compute_logits(SchedulerOutput(chunks, sum(len(p) for p in prompts)))
    decode = SchedulerOutput(
        [
            ScheduledChunk(f"r{i}", [42 + i], len(p), tables[i], True, greedy, 1)
            for i, p in enumerate(prompts)
        ],  # fmt: skip
        3,
    )
    pool_before = runner.kv_cache.clone()
    _, eager = runner.compute_logits(decode)
    written = runner.kv_cache.clone()
    runner.kv_cache.copy_(pool_before)  # the graph step writes the same slots again

    graphs = DecodeGraphs(runner)
    replays = {}
    for b in graphs.buckets:
        graphs.logits[b] = torch.zeros(b, runner.model_config.vocab_size)
        graphs.graphs[b] = replays[b] = _EagerReplay(graphs, b)
    graphs.slots.fill_(123)  # stale values from an earlier, larger batch
    runner.decode_graphs = graphs
    _, replayed = runner.compute_logits(decode)
    assert replays[4].replays == 1 and sum(r.replays for r in replays.values()) == 1
    # Equal up to the float32 rounding of a batch of 4 rows instead of 3.
    torch.testing.assert_close(replayed, eager, atol=2e-4, rtol=1e-3)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    # The padding row wrote nowhere: outside the three decode slots the pool is untouched,
    # and those hold the eager step's K/V (up to the same rounding).
    slots = [(0, 5), (2, 14), (3, 1)]  # (block, offset) of positions 5, 30 and 1
    mask = torch.zeros(runner.kv_cache.shape[2:4], dtype=torch.bool)
    for block, offset in slots:
        mask[block, offset] = True
    assert torch.equal(runner.kv_cache[:, :, ~mask], pool_before[:, :, ~mask])
    torch.testing.assert_close(
        runner.kv_cache[:, :, mask], written[:, :, mask], atol=2e-4, rtol=1e-3
    )
    # A prefill step never replays a graph.
    runner.compute_logits(
        SchedulerOutput([ScheduledChunk("x", [1, 2], 0, [5], True, greedy, 0)], 2)
    )
    assert sum(r.replays for r in replays.values()) == 1


def _capture_fails(self: DecodeGraphs) -> int:
    raise RuntimeError("operation not permitted when stream is capturing")


def test_an_uncapturable_transformers_model_decodes_eagerly(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A host read inside transformers' code fails the capture: that model's decode steps
    run eagerly (with a warning), while the same failure on the native path is raised."""
    monkeypatch.setattr(DecodeGraphs, "capture", _capture_fails)
    runner = _runner(tiny_model_dir, "transformers")
    runner.allocate_kv_cache(8)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.cuda_graphs"):
        assert capture_decode_graphs(runner) is None
    assert "decode steps run eagerly" in caplog.text
    assert "not permitted when stream is capturing" in caplog.text
    native = _runner(tiny_model_dir, "native")
    native.allocate_kv_cache(8)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        capture_decode_graphs(native)


def test_a_window_pool_replay_gives_the_eager_logits(tiny_model_dir: Path, tmp_path: Path) -> None:
    """gpt-oss's window layers in a pool of their own (engine/window_kv.py): the graphs'
    buffers carry the window slots and tables too (blocks out of the window on the null
    block), and a padded replay gives the eager step's logits and writes the same slots."""
    from tests.engine.tiny_hf_models import build_tiny_model

    model_dir = build_tiny_model("gpt-oss", tmp_path / "gpt-oss", tiny_model_dir)
    runner = _runner(model_dir, "native")
    assert runner.window_layout is not None and runner.window_layout.window == 32
    runner.allocate_kv_cache(32)
    greedy = SamplingParams(temperature=0.0)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 80)), [3]]
    tables = [[0], [1, 2, 3, 4, 5], [6]]
    window_tables = [[1], [2, 3, 4, 5, 6], [7]]
    chunks = [ScheduledChunk(f"r{i}", p, 0, tables[i], True, greedy, 0,
                             window_block_ids=window_tables[i])
              for i, p in enumerate(prompts)]  # fmt: skip
    runner.compute_logits(SchedulerOutput(chunks, sum(len(p) for p in prompts)))
    window_tables[1][:2] = [0, 0]  # position 70 attends 39.. : blocks 0 and 1 are freed
    decode = SchedulerOutput(
        [
            ScheduledChunk(
                f"r{i}",
                [42 + i],
                len(p),
                tables[i],
                True,
                greedy,
                1,
                window_block_ids=window_tables[i],
            )
            for i, p in enumerate(prompts)
        ],  # fmt: skip
        3,
    )
    assert runner.window_kv_cache is not None
    before = runner.kv_cache.clone(), runner.window_kv_cache.clone()
    _, eager = runner.compute_logits(decode)
    written = runner.kv_cache.clone(), runner.window_kv_cache.clone()
    runner.kv_cache.copy_(before[0])
    runner.window_kv_cache.copy_(before[1])

    graphs = DecodeGraphs(runner)
    for b in graphs.buckets:
        graphs.logits[b] = torch.zeros(b, runner.model_config.vocab_size)
        graphs.graphs[b] = _EagerReplay(graphs, b)
    assert graphs.window_slots is not None
    graphs.window_slots.fill_(123)  # stale values from an earlier, larger batch
    runner.decode_graphs = graphs
    _, replayed = runner.compute_logits(decode)
    torch.testing.assert_close(replayed, eager, atol=2e-4, rtol=1e-3)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    torch.testing.assert_close(runner.kv_cache, written[0], atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(runner.window_kv_cache, written[1], atol=2e-4, rtol=1e-3)
    assert torch.equal(runner.window_kv_cache[:, :, 0], before[1][:, :, 0])  # null: untouched
