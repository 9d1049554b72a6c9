"""bench.window_kv on the released Gemma 3 1B and gpt-oss-20b configs: a 4096-token
sequence holds every block on a full-attention layer and no more than its window's on a
window layer, through the engine's own KV cache manager."""

from __future__ import annotations

import pytest

from pdserve.bench.window_kv import run


@pytest.mark.parametrize(("model", "window"), [("gemma3-1b", 512), ("gpt-oss-20b", 128)])
def test_a_window_layer_holds_its_window_only(model: str, window: int) -> None:
    r = run(model, tokens=4096, chunk=512, block_size=16)
    assert r["window"] == window
    assert r["full_layer_blocks"] == 4096 // 16
    assert r["window_layer_blocks_max"] <= r["window_bound"] == (window + 512) // 16 + 1
    assert r["window_layer_blocks_end"] == window // 16  # decoding: the window's blocks
    assert r["sequence_kv_bytes_with_end"] < r["sequence_kv_bytes_with_peak"]
    assert r["sequence_kv_bytes_with_peak"] < r["sequence_kv_bytes_without"]
