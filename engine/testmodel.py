"""Deterministic test models: random weights from a seed, a tokenizer trained locally.

``python -m pdserve.engine.testmodel --size tiny|small OUT_DIR`` writes a Hugging Face model
directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat
template, generation_config.json) that both pdserve and ``transformers`` load. Nothing is
downloaded: the byte-level BPE tokenizer is trained with ``tokenizers`` on the corpus shipped
in ``engine/data/corpus.txt``. The same command writes the same bytes.

Weights use a large initializer range so logits are sharp: a greedy token that differs from
the reference then means a bug, not a near-tie. ``VARIANTS`` are small configs of the other
supported shapes (Qwen2 with qkv bias and tied embeddings, MQA, Llama-3 GQA with llama3 RoPE
scaling) for the correctness tests. ``ensure_test_model`` generates once into a cache dir.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

DATA_DIR = Path(__file__).with_name("data")
CORPUS = DATA_DIR / "corpus.txt"
# Bump when the files written change, so cached models are regenerated.
FORMAT_VERSION = 1
CACHE_ENV = "PDSERVE_MODEL_CACHE"

ENDOFTEXT, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, PAD]  # ids 0..3
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TestModelSpec:
    """Shape of a generated model. ``vocab_size`` is the tokenizer's trained size."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    init_std: float = 0.15
    seed: int = 0
    extra_config: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> str:
        blob = json.dumps([FORMAT_VERSION, asdict(self)], sort_keys=True).encode()
        corpus = hashlib.sha256(CORPUS.read_bytes()).hexdigest()
        return hashlib.sha256(blob + corpus.encode()).hexdigest()[:12]


SIZES: dict[str, TestModelSpec] = {
    # ~0.8M params, float32: unit and correctness tests.
    "tiny": TestModelSpec(),
    # ~110M params, bfloat16: benchmarks and end-to-end runs.
    "small": TestModelSpec(
        vocab_size=12288,
        hidden_size=768,
        intermediate_size=2560,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        dtype="bfloat16",
        init_std=0.05,
        seed=1,
    ),
}

# Other supported shapes, tiny and float32, for the transformers comparison tests.
VARIANTS: dict[str, TestModelSpec] = {
    "llama3-gqa": replace(
        SIZES["tiny"],
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        seed=11,
    ),
    "qwen2": replace(
        SIZES["tiny"],
        architecture="Qwen2ForCausalLM",
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        seed=12,
    ),
    "mha": replace(
        SIZES["tiny"],
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        seed=14,
    ),
    "mqa": replace(
        SIZES["tiny"],
        architecture="MistralForCausalLM",
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,  # a head dim the CPU decode kernel has its AVX-512 path for
        extra_config={"sliding_window": None},
        seed=13,
    ),
}


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on the shipped corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer)
    return tok


def _hf_config(spec: TestModelSpec, vocab_size: int) -> dict[str, Any]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {
        "LlamaForCausalLM": LlamaConfig,
        "MistralForCausalLM": MistralConfig,
        "Qwen2ForCausalLM": Qwen2Config,
    }
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling is not None:
        rope = {**spec.rope_scaling, "rope_theta": spec.rope_theta}
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim or spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters=rope,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.init_std,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        **spec.extra_config,
    )
    config = classes[spec.architecture](**kwargs)
    data = config.to_dict()
    data["architectures"] = [spec.architecture]
    data["dtype"] = spec.dtype
    return data


def _random_weights(spec: TestModelSpec, vocab_size: int) -> dict[str, torch.Tensor]:
    """HF-named tensors drawn from one seeded generator in a fixed order."""
    g = torch.Generator().manual_seed(spec.seed)
    h, inter = spec.hidden_size, spec.intermediate_size
    d = spec.head_dim or h // spec.num_heads
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    std = spec.init_std
    qkv_bias = spec.architecture == "Qwen2ForCausalLM"

    def normal(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm_weight() -> torch.Tensor:
        # Not all ones, so a norm applied without its weight is caught.
        return 1.0 + normal(h, scale=0.1)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, h, scale=1.0)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm_weight()
        w[f"{p}.self_attn.q_proj.weight"] = normal(q, h)
        w[f"{p}.self_attn.k_proj.weight"] = normal(kv, h)
        w[f"{p}.self_attn.v_proj.weight"] = normal(kv, h)
        if qkv_bias:
            w[f"{p}.self_attn.q_proj.bias"] = normal(q, scale=0.5)
            w[f"{p}.self_attn.k_proj.bias"] = normal(kv, scale=0.5)
            w[f"{p}.self_attn.v_proj.bias"] = normal(kv, scale=0.5)
        w[f"{p}.self_attn.o_proj.weight"] = normal(h, q)
        w[f"{p}.post_attention_layernorm.weight"] = norm_weight()
        w[f"{p}.mlp.gate_proj.weight"] = normal(inter, h)
        w[f"{p}.mlp.up_proj.weight"] = normal(inter, h)
        w[f"{p}.mlp.down_proj.weight"] = normal(h, inter)
    w["model.norm.weight"] = norm_weight()
    if not spec.tie_word_embeddings:
        # Final-norm outputs are ~1 per element: this gives logits of std ~6 (sharp).
        w["lm_head.weight"] = normal(vocab_size, h, scale=6.0 / h**0.5)
    dtype = getattr(torch, spec.dtype)
    return {name: t.to(dtype).contiguous() for name, t in w.items()}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_test_model(spec: TestModelSpec, out_dir: str | Path) -> Path:
    """Write the HF directory for ``spec`` into ``out_dir`` (created; files overwritten)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    specials = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": specials,
            "bos_token": None,
            "eos_token": ENDOFTEXT,
            "pad_token": PAD,
            "unk_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": spec.max_position_embeddings,
        },
    )
    _write_json(out / "config.json", _hf_config(spec, vocab))
    eos = [SPECIAL_TOKENS.index(ENDOFTEXT), SPECIAL_TOKENS.index(IM_END)]
    _write_json(
        out / "generation_config.json",
        {"eos_token_id": eos, "pad_token_id": SPECIAL_TOKENS.index(PAD), "do_sample": False},
    )
    save_file(_random_weights(spec, vocab), str(out / "model.safetensors"), {"format": "pt"})
    return out


def default_cache_dir() -> Path:
    """``$PDSERVE_MODEL_CACHE`` if set; else ``models/`` at the repository root (git-ignored)
    when running from a checkout; else ``$XDG_CACHE_HOME/pdserve/models`` (an installed
    package never writes into site-packages)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file():
        return checkout / "models"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "pdserve" / "models"


def save_random_model(
    config: Any, out_dir: Path, tokenizer_dir: Path, seed: int, dtype: torch.dtype
) -> Path:
    """Random weights (seeded) of a transformers ``config``, built and saved by transformers
    into ``out_dir`` beside the tokenizer files of ``tokenizer_dir`` (a test model's)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def ensure_test_model(name: str, root: str | Path | None = None) -> Path:
    """Generate the named model (a size or a variant) once into ``root`` and return its dir.

    The directory name carries a fingerprint of the spec and corpus, so a changed spec makes
    a new model. Generation writes to a temporary dir and renames it, so concurrent callers
    never see a half-written model.
    """
    specs = {**SIZES, **VARIANTS}
    if name not in specs:
        raise ValueError(f"test model {name!r} is unknown; choose from {', '.join(specs)}")
    spec = specs[name]
    root = Path(root) if root is not None else default_cache_dir()
    target = root / f"pdserve-{name}-{spec.fingerprint()}"
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write_test_model(spec, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # not a concurrent winner: real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = [*SIZES, *VARIANTS]
    parser.add_argument("--size", choices=choices, default="tiny", help="model to write")
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    args = parser.parse_args(argv)
    out = write_test_model({**SIZES, **VARIANTS}[args.size], args.out_dir)
    print(out)


if __name__ == "__main__":
    main()
