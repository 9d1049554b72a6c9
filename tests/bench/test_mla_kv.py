"""``bench.mla_kv``: the released DeepSeek-V3 config's KV as the engine would hold it. The
native class's pool is the 512 + 64 latent per token and layer, once (one plane), 85x under
the transformers path's expanded per-head K/V."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdserve.bench.mla_kv import DEEPSEEK_V3, path_bytes


def test_native_pool_holds_the_latent_once(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    native = path_bytes(tmp_path, "native", 4096, 16, torch.bfloat16)
    expanded = path_bytes(tmp_path, "transformers", 4096, 16, torch.bfloat16)
    assert (native["kv_planes"], native["kv_heads"], native["slot_dim"]) == (1, 1, 576)
    assert native["bytes_per_token"] == 61 * 576 * 2 == 70_272
    # Expanded: K and V planes of 128 heads, V zero-padded from 128 to the key's 192.
    assert expanded["bytes_per_token"] == 61 * 2 * 128 * 192 * 2
    assert native["handoff_bytes"] == 256 * 61 * 16 * 576 * 2  # 4096 tokens: 256 blocks
    assert 85 < expanded["bytes_per_token"] / native["bytes_per_token"] < 86


def test_tp_handoff_moves_the_latent_once_per_decode_rank(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    native = path_bytes(tmp_path, "native", 4096, 16, torch.bfloat16)["tp_handoff_bytes"]
    expanded = path_bytes(tmp_path, "transformers", 4096, 16, torch.bfloat16)["tp_handoff_bytes"]
    once = 256 * 61 * 16 * 576 * 2
    # Every prefill rank holds the same latent; rank 0's copy goes to each decode rank.
    assert native == {"1->1": once, "8->1": once, "8->2": 2 * once, "8->8": 8 * once}
    # The expanded K/V's 128 heads are split over the ranks: each moves once in total.
    assert set(expanded.values()) == {256 * 61 * 2 * 16 * 128 * 192 * 2}
