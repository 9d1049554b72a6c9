"""gpu_verify's check of the native Gemma 2 / Gemma 3 classes on CUDA (part of the engine
step): tiny random models built by transformers on the device (windows smaller than the
longest prompt; Gemma 2's softcaps; Gemma 3's local RoPE base, scaled global RoPE and tied
embeddings), served natively in float32 with CUDA graphs, chunked prefill and the window
layers' KV in a pool of their own (engine/window_kv.py); greedy tokens must equal
transformers'. The CPU tests (tests/engine/test_native_gemma.py) hold the same
models to logprobs as well."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.gpu_verify_steps import (
    ARRIVALS,
    DEVICE,
    Row,
    _hf_greedy,
    _prompt,
    _run_arrivals,
)

_COMMON: dict[str, Any] = {
    "vocab_size": 2048,  # the tiny test model's tokenizer
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "initializer_range": 0.15,  # sharp logits: a differing token is a bug, not a near-tie
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
# name -> (transformers config class, its fields)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": (
        "Gemma2Config",
        {
            "num_hidden_layers": 2,
            "sliding_window": 48,
            "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 15.0,
            "tie_word_embeddings": False,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 3,
            "sliding_window": 40,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            },
            "tie_word_embeddings": True,
        },
    ),
}


def _build(name: str, out_dir: Path, tokenizer_dir: Path) -> Path:
    import transformers

    class_name, fields = MODELS[name]
    config = getattr(transformers, class_name)(**{**_COMMON, **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def gemma_vs_transformers(model_root: Path) -> list[Row]:
    from transformers import AutoModelForCausalLM

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.testmodel import ensure_test_model

    dev = torch.device(DEVICE)
    tokenizer_dir = ensure_test_model("tiny", model_root)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            model_dir = _build(name, Path(tmp) / name, tokenizer_dir)
            hf: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            hf = hf.to(dev).eval()
            arrivals = [
                (t, f"r{i}", _prompt(n, 100 + i, 2048)) for i, (t, n) in enumerate(ARRIVALS)
            ]
            expected = {rid: _hf_greedy(hf, p, dev) for _, rid, p in arrivals}
            engine = LLMEngine.from_pretrained(
                model_dir, dtype="float32", device=DEVICE, max_num_batched_tokens=64
            )
            native = engine.runner.model_config.impl == "native"
            # Window layers in a pool of their own (engine/window_kv.py).
            windowed = engine.window_layout is not None
            got = _run_arrivals(engine, arrivals)
            same = sum(got[rid] == expected[rid] for rid in expected)
            rows.append(
                Row(
                    "engine",
                    f"{name} native fp32 greedy == transformers, chunked prefill, window pool",
                    native and windowed and same == len(expected),
                    same,
                    f"of {len(expected)} requests",
                    note="" if native and windowed else "not the native class / no window pool",
                )
            )
            del engine, hf
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return rows
