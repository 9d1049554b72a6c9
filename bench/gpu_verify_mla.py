"""The native DeepSeek-V3 class (MLA over a latent KV cache) on the device: greedy tokens of
the engine (fp32, CUDA) equal transformers' for a small random DeepSeek-V3 built by
transformers, with 32 query heads (decode on the MLA decode kernel, two head blocks;
prefill and the mixed steps on the MLA prefill kernel, one 32-head block of 2 tokens per
program), yarn rope and grouped routing,
under chunked prefill and under a pool small enough to preempt. Part of ``gpu_verify``'s
engine step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pdserve.bench.gpu_verify_steps import (
    ARRIVALS,
    DEVICE,
    PREEMPT_ARRIVALS,
    VARIANTS,
    Row,
    greedy_row,
)

CONFIG: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 1024,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "initializer_range": 0.15,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def build_model(model_root: Path) -> Path:
    """The random checkpoint (seeded) beside the test model's tokenizer."""
    from transformers import DeepseekV3Config

    from pdserve.engine.testmodel import ensure_test_model, save_random_model

    out = model_root / "deepseek-v3-mla"
    if not (out / "config.json").is_file():
        tokenizer = ensure_test_model(VARIANTS[0], model_root)
        save_random_model(DeepseekV3Config(**CONFIG), out, tokenizer, 0, torch.float32)
    return out


def mla_vs_transformers(model_root: Path) -> list[Row]:
    from transformers import AutoModelForCausalLM

    from pdserve.engine.loader import load_model_config

    model_dir = build_model(model_root)
    if load_model_config(model_dir).mla is None:
        return [Row("engine", "deepseek-v3: model_impl auto picks the native MLA class", False)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.to(torch.device(DEVICE)).eval()  # type: ignore[arg-type]
    cases: list[tuple[str, list[tuple[int, int]], dict[str, Any]]] = [
        ("chunked prefill (64-token steps)", ARRIVALS, {"max_num_batched_tokens": 64}),
        (
            "preemption (48-block pool)",
            PREEMPT_ARRIVALS,
            {"num_kv_blocks": 48, "max_model_len": 640, "max_num_batched_tokens": 128},
        ),
    ]
    name = "deepseek-v3 MLA fp32"
    return [greedy_row(hf, model_dir, name, *case, seed=300) for case in cases]
