"""Tiny random models of architectures pdserve runs through transformers, built by
transformers itself (seeded) and saved with safetensors beside the tiny test model's
tokenizer. Dimensions are tiny so each runs in seconds on a CPU in float32; the
initializer range is large so logits are sharp (a differing greedy token is a bug, not a
near-tie)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pdserve.engine.testmodel import save_random_model

VOCAB = 2048  # the tiny test model's tokenizer
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "initializer_range": 0.15,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

# name -> (config class in transformers, overrides of _COMMON)
SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3-moe": ("Qwen3MoeConfig", {**_MOE, "decoder_sparse_step": 1}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Windows smaller than the longest prompt; Gemma 2 also caps attention logits.
    "gemma2": (
        "Gemma2Config",
        {"sliding_window": 48, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {"sliding_window": 40, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", {"pad_token_id": 0}),
    "granite": (
        "GraniteConfig",
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 2.0},
    ),
    "glm4": ("Glm4Config", {"pad_token_id": 0}),
    "gpt-oss": (
        "GptOssConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "head_dim": 8,  # the rotary part (transformers sets it so)
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
        },
    ),
    "deepseek-v2": (
        "DeepseekV2Config",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_shared_experts": 2,
            "routed_scaling_factor": 1.5,
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
        },
    ),
}


def tiny_config(name: str, **overrides: Any) -> Any:
    """The named tiny model's transformers config (``overrides`` on top)."""
    import transformers

    class_name, spec = SPECS[name]
    return getattr(transformers, class_name)(**{**_COMMON, **spec, **overrides})


def build_tiny_model(
    name: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides: Any
) -> Path:
    """Write the named tiny model (config.json, model.safetensors, tokenizer) to ``out_dir``."""
    config = tiny_config(name, **overrides)
    return save_random_model(config, out_dir, tokenizer_dir, seed, torch.float32)
