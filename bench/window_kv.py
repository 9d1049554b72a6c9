"""KV blocks a long sequence holds on a sliding-window layer against a full-attention layer,
with the window layers in a pool of their own (engine/window_kv.py).

    python -P -m pdserve.bench.window_kv [--model gemma3-1b|gpt-oss-20b] [--tokens 4096]
                                         [--chunk 512] [--block-size 16]
                                         [--kv-cache-dtype auto|int8|fp8_e4m3] [--out FILE.json]

Writes the released config.json of the model (architecture fields only, no weights) to a
temporary directory and reads it as the engine does (``load_model_config``: each layer's
window), plans the window pool the model runner would allocate (``plan_window_layout``)
and drives the engine's own KV cache manager through one sequence of ``--tokens`` tokens:
the first half a prompt in ``--chunk``-token chunks (chunked prefill), the rest decoded
one token a step. Counts the blocks the sequence holds in each pool after every step (the
window pool's null block not counted) and the KV bytes of the sequence (bf16, or the
``--kv-cache-dtype`` an engine would keep: one byte an element for int8 / fp8, whose
per-layer scales are a fixed few bytes a layer) with and without the window pool. Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.engine.kv_cache_manager import KVCacheManager, cdiv
from pdserve.engine.loader import ModelConfig, load_model_config
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.window_kv import WindowKV, WindowLayout, plan_window_layout

# The released checkpoints' config.json (architecture fields only).
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma3-1b": {  # google/gemma-3-1b-it: five window-512 layers, then a full one
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "query_pre_attn_scalar": 256,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    },
    "gpt-oss-20b": {  # openai/gpt-oss-20b: window-128 and full layers alternate
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    },
}


def _config(model: str) -> ModelConfig:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(CONFIGS[model]))
        return load_model_config(tmp)


@dataclass(frozen=True)
class _Sequence:
    cfg: ModelConfig
    layout: WindowLayout
    window: WindowKV
    kv: KVCacheManager
    request: Request


def _one_sequence(
    model: str, tokens: int, chunk: int, max_len: int, block_size: int, prefix_caching: bool
) -> _Sequence:
    """One ``tokens``-token request over pools planned for it alone, as the engine plans
    them for ``chunk``-token steps."""
    cfg = _config(model)
    layout = plan_window_layout(
        cfg.kv_layers,
        block_size,
        max_num_seqs=1,
        max_num_batched_tokens=chunk,
        max_model_len=max_len,
    )
    if layout is None:
        raise ValueError(f"{model}: no mix of window and full-attention layers")
    window = WindowKV(layout.window, block_size, layout.num_blocks, prefix_caching)
    kv = KVCacheManager(cdiv(tokens, block_size), block_size, prefix_caching, window)
    request = Request("seq", list(range(tokens)), SamplingParams(max_tokens=1), 0.0)
    return _Sequence(cfg, layout, window, kv, request)


def kv_element_bytes(kv_cache_dtype: str) -> int:
    """Bytes of one KV element of a bf16 model's pool under ``EngineConfig.kv_cache_dtype``."""
    import torch

    from pdserve.engine.kv_scales import kv_cache_torch_dtype

    dtype = kv_cache_torch_dtype(kv_cache_dtype, torch.bfloat16)
    return torch.empty((), dtype=dtype).element_size()


def handoff_bytes(
    model: str, prompt_tokens: int, block_size: int = 16, kv_cache_dtype: str = "auto"
) -> dict[str, Any]:
    """The bytes (bf16, or ``kv_cache_dtype``) one P/D hand-off of a ``prompt_tokens`` prompt
    moves with the window pool on both sides (full layers: every block; window layers: the
    blocks the decode side's reservation holds, by the engine's own ``allocate_slots``) and
    with every layer whole (one pool)."""
    seq = _one_sequence(model, prompt_tokens, prompt_tokens, prompt_tokens + 1, block_size, False)
    cfg, layout, window, kv, request = seq.cfg, seq.layout, seq.window, seq.kv, seq.request
    # What a decode engine reserves for a remote prefill (Scheduler.reserve_remote_prefill).
    if kv.allocate_slots(request, prompt_tokens, window_start=prompt_tokens) is None:
        raise AssertionError("the planned pools cannot hold the prompt")
    blocks, window_blocks = len(request.block_ids), window.num_held(request)
    elem = kv_element_bytes(kv_cache_dtype)
    layer_block = 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem
    num_window, num_full = len(layout.layers), cfg.num_layers - len(layout.layers)
    every_block = cfg.num_layers * blocks * layer_block
    windowed = (num_full * blocks + num_window * window_blocks) * layer_block
    return {
        "model": model,
        "prompt_tokens": prompt_tokens,
        "block_size": block_size,
        "kv_cache_dtype": kv_cache_dtype,
        "window": layout.window,
        "window_layers": num_window,
        "full_layers": num_full,
        "blocks": blocks,
        "window_layer_blocks_sent": window_blocks,
        "bytes_every_block": every_block,
        "bytes_windowed": windowed,
    }


def run(
    model: str, tokens: int, chunk: int, block_size: int, kv_cache_dtype: str = "auto"
) -> dict[str, Any]:
    seq = _one_sequence(model, tokens, chunk, tokens, block_size, True)
    cfg, layout, window, kv, request = seq.cfg, seq.layout, seq.window, seq.kv, seq.request
    prompt = tokens // 2
    most = 0
    while request.num_computed_tokens < tokens:
        left = prompt - request.num_computed_tokens
        n = min(chunk, left) if left > 0 else 1
        if kv.allocate_slots(request, n) is None:
            raise AssertionError("the planned window pool ran out of blocks")
        request.num_computed_tokens += n
        kv.cache_full_blocks(request)
        most = max(most, window.num_held(request))
    full_blocks = len(request.block_ids)
    elem = kv_element_bytes(kv_cache_dtype)
    layer_block = 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem
    num_window, num_full = len(layout.layers), cfg.num_layers - len(layout.layers)
    without = cfg.num_layers * full_blocks * layer_block
    with_pool = (num_full * full_blocks + num_window * most) * layer_block
    at_end = (num_full * full_blocks + num_window * window.num_held(request)) * layer_block
    return {
        "model": model,
        "tokens": tokens,
        "chunk": chunk,
        "block_size": block_size,
        "kv_cache_dtype": kv_cache_dtype,
        "window": layout.window,
        "window_layers": num_window,
        "full_layers": num_full,
        "full_layer_blocks": full_blocks,
        "window_layer_blocks_max": most,
        "window_layer_blocks_end": window.num_held(request),
        "window_bound": cdiv(layout.window + chunk, block_size) + 1,
        "sequence_kv_bytes_without": without,
        "sequence_kv_bytes_with_peak": with_pool,
        "sequence_kv_bytes_with_end": at_end,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="gemma3-1b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8_e4m3"], default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    r = run(args.model, args.tokens, args.chunk, args.block_size, args.kv_cache_dtype)
    label = "bf16" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    mib = 2**20
    print(
        f"{r['model']}: one {r['tokens']}-token sequence (prefill chunks of {r['chunk']}, "
        f"then decode), block {r['block_size']}, window {r['window']}"
    )
    print(f"{'layer':<22}{'layers':>8}{'blocks held (max)':>20}{'at the end':>12}")
    print(
        f"{'full attention':<22}{r['full_layers']:>8}"
        f"{r['full_layer_blocks']:>20}{r['full_layer_blocks']:>12}"
    )
    print(
        f"{'window ' + str(r['window']):<22}{r['window_layers']:>8}"
        f"{r['window_layer_blocks_max']:>20}{r['window_layer_blocks_end']:>12}"
        f"   (bound cdiv(W + chunk, B) + 1 = {r['window_bound']})"
    )
    without, peak, end = (r[f"sequence_kv_bytes_{k}"] for k in ("without", "with_peak", "with_end"))
    print(
        f"sequence KV ({label}): {without / mib:.1f} MiB with every layer kept whole; with the "
        f"window pool {peak / mib:.1f} MiB at its peak ({without / peak:.2f}x less), "
        f"{end / mib:.1f} MiB at the end ({without / end:.2f}x less)"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
