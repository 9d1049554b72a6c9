"""Bytes of a quantized MoE checkpoint's experts as shipped against as the native engine
holds them (dequantized at load, ``engine/expert_quant.py``), and what the dequantization
costs at load on this CPU.

    python -P -m pdserve.bench.expert_memory [--out FILE.json]

For the released configs (architecture fields and ``quantization_config`` only, no
weights; read as the engine reads them, ``load_model_config``): expert parameters, bytes in
the checkpoint (MXFP4: half a byte per value plus one e8m0 byte per 32; fp8: a byte per
value plus a float32 scale per 128x128 block) and bytes held in bfloat16 and float32. Then
one expert of each model's shape is dequantized from random bytes, timed (best of
``--rounds``), and scaled to the whole model's experts. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.window_kv import CONFIGS as WINDOW_CONFIGS
from pdserve.engine.expert_quant import dequantize_fp8_blocks, dequantize_mxfp4
from pdserve.engine.loader import ModelConfig, load_model_config

_GPT_OSS_20B = {
    **WINDOW_CONFIGS["gpt-oss-20b"],
    "quantization_config": {"quant_method": "mxfp4"},
}
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": _GPT_OSS_20B,
    "gpt-oss-120b": {  # openai/gpt-oss-120b: the 20b's layer, 36 deep, 128 experts
        **_GPT_OSS_20B,
        "num_hidden_layers": 36,
        "num_local_experts": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
    },
    "Qwen3-30B-A3B-FP8": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "rope_theta": 1_000_000.0,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
        },
    },
}
GIB = 1 << 30


def _config(model: str) -> ModelConfig:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(CONFIGS[model]))
        return load_model_config(tmp)


def _shipped_bytes_per_expert(cfg: ModelConfig) -> int:
    """One expert's gate, up and down projections in the checkpoint's format."""
    assert cfg.moe is not None and cfg.moe.quantized is not None
    h, i = cfg.hidden_size, cfg.moe.intermediate_size
    shapes = [(2 * i, h), (h, i)]
    if cfg.moe.quantized.method == "mxfp4":
        return sum(rows * cols // 2 + rows * cols // 32 for rows, cols in shapes)
    br, bc = cfg.moe.quantized.block or (128, 128)
    shapes = [(i, h), (i, h), (h, i)]  # gate and up are separate tensors, each with scales
    return sum(r * c + 4 * (-(-r // br)) * (-(-c // bc)) for r, c in shapes)


def _time_one_expert(cfg: ModelConfig, dtype: torch.dtype, rounds: int) -> float:
    """Seconds to dequantize one expert (random bytes of the real shape), best of rounds."""
    assert cfg.moe is not None and cfg.moe.quantized is not None
    h, i, quant = cfg.hidden_size, cfg.moe.intermediate_size, cfg.moe.quantized
    g = torch.Generator().manual_seed(0)
    best = float("inf")
    for _ in range(rounds + 1):  # the first round warms up
        if quant.method == "mxfp4":
            tensors = [
                (torch.randint(0, 256, (r, c // 32, 16), dtype=torch.uint8, generator=g),
                 torch.randint(120, 130, (r, c // 32), dtype=torch.uint8, generator=g))
                for r, c in ((2 * i, h), (h, i))
            ]  # fmt: skip
            start = time.perf_counter()
            for blocks, scales in tensors:
                dequantize_mxfp4(blocks, scales, dtype, "bench")
        else:
            block = quant.block or (128, 128)
            fp8 = [
                (torch.randn(r, c, generator=g).to(torch.float8_e4m3fn),
                 torch.rand(-(-r // block[0]), -(-c // block[1]), generator=g))
                for r, c in ((i, h), (i, h), (h, i))
            ]  # fmt: skip
            start = time.perf_counter()
            for weight, scale in fp8:
                dequantize_fp8_blocks(weight, scale, block, dtype, "bench")
        best = min(best, time.perf_counter() - start)
    return best


def measure(model: str, rounds: int) -> dict[str, Any]:
    cfg = _config(model)
    assert cfg.moe is not None and cfg.moe.quantized is not None
    experts = len(cfg.moe.sparse_layers) * cfg.moe.num_experts
    params = 3 * cfg.hidden_size * cfg.moe.intermediate_size * experts
    one = _time_one_expert(cfg, torch.bfloat16, rounds)
    return {
        "model": model,
        "format": cfg.moe.quantized.describe(),
        "experts": experts,
        "expert_params": params,
        "shipped_bytes": _shipped_bytes_per_expert(cfg) * experts,
        "held_bf16_bytes": 2 * params,
        "held_fp32_bytes": 4 * params,
        "dequant_s_per_expert_bf16": one,
        "dequant_s_all_experts_bf16": one * experts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="expert_memory.json")
    args = parser.parse_args()
    rows = [measure(model, args.rounds) for model in CONFIGS]
    print(
        f"{'model':<20} {'format':<20} {'expert params':>14} {'shipped':>10} "
        f"{'held bf16':>10} {'held fp32':>10} {'dequant/expert':>15} {'all experts':>12}"
    )
    for r in rows:
        sizes = [r[k] / GIB for k in ("shipped_bytes", "held_bf16_bytes", "held_fp32_bytes")]
        print(
            f"{r['model']:<20} {r['format']:<20} {r['expert_params'] / 1e9:>12.2f} B "
            + " ".join(f"{gib:>6.2f} GiB" for gib in sizes)
            + f" {r['dequant_s_per_expert_bf16'] * 1e3:>12.1f} ms"
            f" {r['dequant_s_all_experts_bf16']:>10.1f} s"
        )
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
