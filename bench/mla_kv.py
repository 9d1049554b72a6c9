"""KV bytes of DeepSeek-V3: the native class's latent pool against the transformers path's
expanded per-head K/V, per token and on the wire for one P/D hand-off.

    python -P -m pdserve.bench.mla_kv [--prompt-tokens 4096] [--block-size 16]
                                      [--dtype bfloat16] [--out FILE.json]

Writes the released DeepSeek-V3 config.json (61 layers, 128 heads, qk 128 + 64 / v 128,
kv_lora_rank 512, yarn rope) to a temporary directory (no weights), reads it through both
model paths (``model_impl`` native and transformers) as the engine does, and sizes each
path's pool ``[L, 2, N, B, Hkv, D]`` from it. The wire bytes of one hand-off are the
sender's layout (``kvtransfer.blocks.pool_layout`` of that pool shape) times the prompt's
blocks and layers: what ``TransferResult.bytes`` reports (tests/kvtransfer/test_mla_handoff.py
checks that equality on a real transfer). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.loader import load_model_config
from pdserve.kvtransfer.blocks import pool_layout

# The released checkpoint's config.json (architecture fields only).
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def path_bytes(
    model_dir: Path, impl: str, prompt_tokens: int, block_size: int, dtype: torch.dtype
) -> dict[str, Any]:
    """One path's pool geometry, bytes per token and hand-off bytes."""
    cfg = load_model_config(model_dir, impl)
    blocks = math.ceil(prompt_tokens / block_size)
    shape = (cfg.num_layers, 2, blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    layout = pool_layout(torch.empty(shape, dtype=dtype, device="meta"), cfg.kv_identity)
    per_token = cfg.num_layers * layout.block_bytes() // block_size
    return {
        "impl": cfg.impl,
        "kv_heads": cfg.num_kv_heads,
        "slot_dim": cfg.head_dim,
        "kv_layers": [{"key_dim": s.key_dim, "value_dim": s.value_dim} for s in cfg.kv_layers[:1]],
        "bytes_per_token": per_token,
        "handoff_blocks": blocks,
        "handoff_bytes": blocks * cfg.num_layers * layout.block_bytes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="hand-off prompt")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/...)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "DeepSeek-V3"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(DEEPSEEK_V3))
        rows = {
            impl: path_bytes(model_dir, impl, args.prompt_tokens, args.block_size, dtype)
            for impl in ("native", "transformers")
        }
    latent, expanded = rows["native"], rows["transformers"]
    # What the latent itself takes: one K half per slot (the V half duplicates it).
    latent_only = latent["bytes_per_token"] // 2
    print(f"DeepSeek-V3 KV, {args.dtype}, block {args.block_size}, hand-off of "
          f"{args.prompt_tokens} prompt tokens")  # fmt: skip
    print(f"{'pool':<34} {'Hkv x D':>10} {'bytes/token':>12} {'hand-off MiB':>13} {'ratio':>7}")
    table = [
        ("expanded K/V (transformers path)", expanded, expanded["bytes_per_token"]),
        ("latent, K+V halves (native MLA)", latent, latent["bytes_per_token"]),
        ("latent alone (if V half dropped)", latent, latent_only),
    ]
    for name, row, per_token in table:
        handoff = per_token * row["handoff_blocks"] * args.block_size
        ratio = expanded["bytes_per_token"] / per_token
        print(
            f"{name:<34} {row['kv_heads']:>4} x {row['slot_dim']:<4} {per_token:>12,} "
            f"{handoff / 2**20:>13.1f} {ratio:>6.1f}x"
        )
    result = {
        "config": "DeepSeek-V3",
        "dtype": args.dtype,
        "block_size": args.block_size,
        "prompt_tokens": args.prompt_tokens,
        "paths": rows,
        "latent_content_bytes_per_token": latent_only,
        "ratio_pool": expanded["bytes_per_token"] / latent["bytes_per_token"],
        "ratio_latent_content": expanded["bytes_per_token"] / latent_only,
    }
    out = args.out or Path("bench/results") / f"mla-kv-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
