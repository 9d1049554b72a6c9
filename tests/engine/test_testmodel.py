"""The generated test models: deterministic bytes, loadable by transformers, sharp logits."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from pdserve.engine.loader import load_model_config
from pdserve.engine.testmodel import SIZES, ensure_test_model, main


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_command_writes_same_bytes(tmp_path: Path) -> None:
    main(["--size", "tiny", str(tmp_path / "a")])
    main(["--size", "tiny", str(tmp_path / "b")])
    a, b = digests(tmp_path / "a"), digests(tmp_path / "b")
    assert set(a) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert a == b


def test_tiny_model_loads_in_transformers_with_sharp_logits(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = load_model_config(tiny_model_dir)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.num_kv_heads < cfg.num_heads
    assert cfg.vocab_size == len(tok) == model.config.vocab_size
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 5e6
    assert set(cfg.eos_token_ids) == {
        tok.convert_tokens_to_ids("<|endoftext|>"),
        tok.convert_tokens_to_ids("<|im_end|>"),
    }
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode("Ada carried the golden lamp to the harbour. 東京の朝 🙂")
    assert tok.decode(ids) == "Ada carried the golden lamp to the harbour. 東京の朝 🙂"
    prompt = torch.randint(4, cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(prompt).logits[0]
    top2 = logits.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    # Sharp: the top token is usually far ahead of the runner-up (float32 noise is ~1e-5),
    # so a greedy token that differs from transformers means a bug, not a near-tie.
    assert gap.median() > 0.5 and (gap < 1e-3).float().mean() < 0.01
    assert logits.softmax(-1).max(-1).values.median() > 0.3


def test_small_spec_is_about_a_hundred_million_params() -> None:
    s = SIZES["small"]
    d = s.head_dim or s.hidden_size // s.num_heads
    per_layer = (
        s.hidden_size * d * (2 * s.num_heads + 2 * s.num_kv_heads)
        + 3 * s.hidden_size * s.intermediate_size
        + 2 * s.hidden_size
    )
    total = s.num_layers * per_layer + 2 * s.vocab_size * s.hidden_size + s.hidden_size
    assert 100e6 <= total <= 150e6
    assert s.dtype == "bfloat16" and s.max_position_embeddings >= 4096


def test_ensure_test_model_generates_once(tmp_path: Path) -> None:
    first = ensure_test_model("mqa", tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = ensure_test_model("mqa", tmp_path)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dirs left behind
    with pytest.raises(ValueError, match="unknown"):
        ensure_test_model("huge", tmp_path)


def test_variants_have_the_shapes_they_claim(test_model) -> None:
    qwen = load_model_config(test_model("qwen2"))
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.qkv_bias and qwen.tie_word_embeddings
    mqa = load_model_config(test_model("mqa"))
    assert mqa.num_kv_heads == 1 and mqa.sliding_window is None
    llama3 = load_model_config(test_model("llama3-gqa"))
    assert llama3.rope_scaling is not None and llama3.rope_scaling["rope_type"] == "llama3"
    assert llama3.num_heads // llama3.num_kv_heads == 4
