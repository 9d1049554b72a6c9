"""The KV bytes per token a decode replica reports count a window model's window layers
whether they keep their KV in a pool of their own or in the one pool (tiny gpt-oss, half
its layers windowed)."""

from __future__ import annotations

from pathlib import Path

from pdserve.deployments.tp_kv import replica_kv_bytes_per_token
from pdserve.engine.llm_engine import LLMEngine
from tests.engine.tiny_hf_models import build_tiny_model


def test_window_pool_replica_counts_every_layer(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = build_tiny_model("gpt-oss", tmp_path, tiny_model_dir, swiglu_limit=1.5)
    pooled = LLMEngine.from_pretrained(model_dir, num_kv_blocks=16, device="cpu")
    single = LLMEngine.from_pretrained(
        model_dir, num_kv_blocks=16, device="cpu", window_kv_pool=False
    )
    assert pooled.window_layout is not None and single.window_layout is None
    heads = pooled.model_config.num_kv_heads
    window_pool = pooled.window_kv_cache
    got = replica_kv_bytes_per_token(pooled.kv_cache, heads, window_pool)
    want = replica_kv_bytes_per_token(single.kv_cache, heads)
    layers = pooled.model_config.num_layers
    assert got == want == layers * 2 * heads * pooled.model_config.head_dim * 4  # float32
    assert pooled.kv_cache.shape[0] < layers  # the full pool alone would undercount
