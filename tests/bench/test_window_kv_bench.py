"""bench.window_kv on the released Gemma 3 1B and gpt-oss-20b configs: a 4096-token
sequence holds every block on a full-attention layer and no more than its window's on a
window layer, through the engine's own KV cache manager."""

from __future__ import annotations

import pytest

from pdserve.bench.window_kv import handoff_bytes, run


@pytest.mark.parametrize(("model", "window"), [("gemma3-1b", 512), ("gpt-oss-20b", 128)])
def test_a_window_layer_holds_its_window_only(model: str, window: int) -> None:
    r = run(model, tokens=4096, chunk=512, block_size=16)
    assert r["window"] == window
    assert r["full_layer_blocks"] == 4096 // 16
    assert r["window_layer_blocks_max"] <= r["window_bound"] == (window + 512) // 16 + 1
    assert r["window_layer_blocks_end"] == window // 16  # decoding: the window's blocks
    assert r["sequence_kv_bytes_with_end"] < r["sequence_kv_bytes_with_peak"]
    assert r["sequence_kv_bytes_with_peak"] < r["sequence_kv_bytes_without"]


@pytest.mark.parametrize(("model", "window"), [("gemma3-1b", 512), ("gpt-oss-20b", 128)])
def test_a_window_model_handoff_moves_the_window_blocks_only(model: str, window: int) -> None:
    r = handoff_bytes(model, 4000, block_size=16)
    blocks = 4000 // 16
    first = (4000 - window + 1) // 16  # the first decoded token (position 4000) attends it
    assert (r["blocks"], r["window_layer_blocks_sent"]) == (blocks, blocks - first)
    layer_block = r["bytes_every_block"] // (blocks * (r["window_layers"] + r["full_layers"]))
    assert r["bytes_windowed"] == layer_block * (
        r["full_layers"] * blocks + r["window_layers"] * (blocks - first)
    )


def test_an_int8_cache_halves_the_bytes_and_keeps_the_blocks() -> None:
    bf16 = run("gpt-oss-20b", tokens=4096, chunk=512, block_size=16)
    int8 = run("gpt-oss-20b", tokens=4096, chunk=512, block_size=16, kv_cache_dtype="int8")
    assert int8["window_layer_blocks_max"] == bf16["window_layer_blocks_max"]
    for key in ("without", "with_peak", "with_end"):
        assert 2 * int8[f"sequence_kv_bytes_{key}"] == bf16[f"sequence_kv_bytes_{key}"]
    hand = handoff_bytes("gpt-oss-20b", 4000, kv_cache_dtype="int8")
    assert 2 * hand["bytes_windowed"] == handoff_bytes("gpt-oss-20b", 4000)["bytes_windowed"]
