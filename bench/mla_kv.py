"""KV bytes of DeepSeek-V3: the native class's latent pool against the transformers path's
expanded per-head K/V, per token and on the wire for one P/D hand-off.

    python -P -m pdserve.bench.mla_kv [--prompt-tokens 4096] [--block-size 16]
                                      [--dtype bfloat16] [--out FILE.json]

Writes the released DeepSeek-V3 config.json (61 layers, 128 heads, qk 128 + 64 / v 128,
kv_lora_rank 512, yarn rope) to a temporary directory (no weights), reads it through both
model paths (``model_impl`` native and transformers) as the engine does, and sizes each
path's pool ``[L, P, N, B, Hkv, D]`` from it (P = ``kv_planes``: 2 expanded, 1 latent).
The wire bytes of one hand-off are the sender's layout (``kvtransfer.blocks.pool_layout``
of that pool shape) times the prompt's blocks and layers: what ``TransferResult.bytes``
reports (tests/kvtransfer/test_mla_handoff.py checks that equality on a real transfer).
Between tensor-parallel replicas (``--prefill-tp``, ``--decode-tp``) the wire bytes are
summed over the rank pairs ``kvtransfer.tp_plan.plan`` moves: the expanded K/V's heads
once each, the latent (one head on every rank) once per decode rank
(tests/deployments/test_tp_handoff.py checks that count on real TP transfers). Prints the
tables and writes JSON.
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
from pdserve.kvtransfer import tp_plan
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


# A scaled-down DeepSeek-V3 with the released model's latent slot (kv_lora_rank 512 +
# rope 64) and head sizes, but few layers, heads and experts: small enough to prefill on a
# CPU for a measured hand-off (``bench.kvtransfer --mla-handoff``).
SMALL_MLA_OVERRIDES: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 256,
    "max_position_embeddings": 8192,
}


def write_small_mla_model(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Random weights of the scaled-down DeepSeek-V3 (bfloat16, built by transformers) and
    the tokenizer files of ``tokenizer_dir`` (its vocabulary sizes the model)."""
    from transformers import AutoConfig, AutoTokenizer

    from pdserve.engine.testmodel import save_random_model

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    fields = {**DEEPSEEK_V3, **SMALL_MLA_OVERRIDES, "vocab_size": vocab}
    for key in ("architectures", "model_type", "torch_dtype"):
        fields.pop(key)
    config = AutoConfig.for_model("deepseek_v3", **fields)
    config.architectures = ["DeepseekV3ForCausalLM"]
    return save_random_model(config, out_dir, tokenizer_dir, seed, torch.bfloat16)


def path_bytes(
    model_dir: Path, impl: str, prompt_tokens: int, block_size: int, dtype: torch.dtype
) -> dict[str, Any]:
    """One path's pool geometry, bytes per token and hand-off bytes."""
    cfg = load_model_config(model_dir, impl)
    blocks = math.ceil(prompt_tokens / block_size)
    shape = (cfg.num_layers, cfg.kv_planes, blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    layout = pool_layout(torch.empty(shape, dtype=dtype, device="meta"), cfg.kv_identity)
    per_token = cfg.num_layers * layout.block_bytes() // block_size
    return {
        "impl": cfg.impl,
        "kv_planes": cfg.kv_planes,
        "kv_heads": cfg.num_kv_heads,
        "slot_dim": cfg.head_dim,
        "kv_layers": [{"key_dim": s.key_dim, "value_dim": s.value_dim} for s in cfg.kv_layers[:1]],
        "bytes_per_token": per_token,
        "handoff_blocks": blocks,
        "handoff_bytes": blocks * cfg.num_layers * layout.block_bytes(),
        "tp_handoff_bytes": {
            f"{a}->{b}": tp_wire_bytes(layout, a, b) * blocks * cfg.num_layers for a, b in TP_PAIRS
        },
    }


def tp_wire_bytes(layout: Any, prefill_tp: int, decode_tp: int) -> int:
    """Bytes of one block of one layer that a prefill replica of ``prefill_tp`` ranks sends
    a decode replica of ``decode_tp`` ranks (every pair ``tp_plan.plan`` moves)."""
    prefill = [tp_plan.rank_layout(layout, prefill_tp, r) for r in range(prefill_tp)]
    decode = [tp_plan.rank_layout(layout, decode_tp, r) for r in range(decode_tp)]
    return sum(layout.block_bytes(s.num_heads) for s in tp_plan.plan(prefill, decode).values())


# (prefill TP, decode TP): DeepSeek-V3 is served at TP=8.
TP_PAIRS = [(1, 1), (8, 1), (8, 2), (8, 8)]


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
    print(f"DeepSeek-V3 KV, {args.dtype}, block {args.block_size}, hand-off of "
          f"{args.prompt_tokens} prompt tokens")  # fmt: skip
    print(f"{'pool':<40} {'P x Hkv x D':>14} {'bytes/token':>12} {'hand-off MiB':>13} {'ratio':>7}")
    table = [
        ("expanded K/V (transformers path)", expanded),
        ("latent, as stored and moved (native)", latent),
    ]
    for name, row in table:
        per_token = row["bytes_per_token"]
        ratio = expanded["bytes_per_token"] / per_token
        geometry = f"{row['kv_planes']} x {row['kv_heads']} x {row['slot_dim']}"
        print(
            f"{name:<40} {geometry:>14} {per_token:>12,} "
            f"{row['handoff_bytes'] / 2**20:>13.1f} {ratio:>6.1f}x"
        )
    print(f"\nhand-off of {args.prompt_tokens} prompt tokens between TP replicas, MiB on the wire")
    print(f"{'prefill TP -> decode TP':<24} {'expanded K/V':>13} {'latent':>9} {'ratio':>7}")
    for pair, wire in latent["tp_handoff_bytes"].items():
        full = expanded["tp_handoff_bytes"][pair]
        print(f"{pair:<24} {full / 2**20:>13.1f} {wire / 2**20:>9.1f} {full / wire:>6.1f}x")
    result = {
        "config": "DeepSeek-V3",
        "dtype": args.dtype,
        "block_size": args.block_size,
        "prompt_tokens": args.prompt_tokens,
        "paths": rows,
        "ratio": expanded["bytes_per_token"] / latent["bytes_per_token"],
    }
    out = args.out or Path("bench/results") / f"mla-kv-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
