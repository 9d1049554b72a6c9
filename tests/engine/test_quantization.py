"""Quantized checkpoints and at-load quantization, end to end through the engine.

The checkpoints are written from the generated tiny model by compressed-tensors itself
(``engine/testmodel_quant.py``) and by the fp8 format writer; tests that need the library
skip without it (the ``quant`` extra).
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.quantization import QuantScheme, read_quantization_config
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.testmodel_quant import write_quantized
from pdserve.kernels.quant_ops import weight_dtype_of

HAS_CT = importlib.util.find_spec("compressed_tensors") is not None
needs_ct = pytest.mark.skipif(not HAS_CT, reason="compressed-tensors not installed (quant extra)")
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _prompts(n: int = 32, length: int = 12) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 2000) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def quantized(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("quantized")
    made: dict[str, Path] = {}

    def get(scheme: str) -> Path:
        if scheme not in made:
            made[scheme] = write_quantized(scheme, tiny_model_dir, root / scheme)
        return made[scheme]

    return get


@pytest.fixture(scope="module")
def float_first_tokens(tiny_model_dir: Path) -> list[int]:
    engine = LLMEngine.from_pretrained(tiny_model_dir, dtype="float32")
    return [o.token_ids[0] for o in engine.generate(_prompts(), FIRST)]


def _first_token_agreement(engine: LLMEngine, reference: list[int]) -> float:
    outs = engine.generate(_prompts(), FIRST)
    return sum(o.token_ids[0] == r for o, r in zip(outs, reference, strict=True)) / len(reference)


def test_reads_fp8_and_compressed_tensors_configs():
    fp8 = read_quantization_config(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    )
    assert fp8 == QuantScheme("fp8", "fp8", block=(128, 128))
    ct = read_quantization_config(
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "ignore": ["lm_head"],
                "config_groups": {
                    "g": {
                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                        "input_activations": {
                            "num_bits": 8,
                            "type": "int",
                            "strategy": "token",
                            "dynamic": True,
                        },
                    }
                },
            }
        }
    )
    assert ct == QuantScheme("int8", "int8")
    assert read_quantization_config({}) is None


def test_unknown_quant_method_is_named():
    with pytest.raises(ValueError, match="'awq' is not supported"):
        read_quantization_config({"quantization_config": {"quant_method": "awq"}})


def test_config_rejects_an_unknown_at_load_method(tiny_model_dir: Path):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=str(tiny_model_dir), quantization="int4")


@pytest.mark.parametrize(
    ("scheme", "kind", "bound"),
    [
        pytest.param("W8A8", "int8 (w8a8)", 0.8, marks=needs_ct),
        pytest.param("W8A16", "int8 (grouped), int8 (weight-only)", 0.85, marks=needs_ct),
        pytest.param("FP8_DYNAMIC", "float8_e4m3", 0.5, marks=needs_ct),
        pytest.param("FP8_BLOCK", "float8_e4m3", 0.5, marks=needs_ct),
        pytest.param("FP8_HF_BLOCK", "float8_e4m3", 0.5),
    ],
)
def test_serves_quantized_checkpoints(quantized, float_first_tokens, scheme, kind, bound):
    # Bounds: the tiny model is narrow (hidden 128), so one weight's rounding moves a logit
    # more than in a real model; e4m3 keeps 3 mantissa bits, int8 per channel about 7.
    engine = LLMEngine.from_pretrained(quantized(scheme), dtype="float32")
    assert weight_dtype_of(engine.runner.model) == kind
    agreement = _first_token_agreement(engine, float_first_tokens)
    assert agreement >= bound, f"{scheme}: first tokens agree with float32 on {agreement:.0%}"


@needs_ct
def test_w8a16_checkpoint_matches_transformers_on_the_same_checkpoint(quantized):
    """Weight-only int8: the same dequantized weights in transformers give the same tokens."""
    from transformers import AutoModelForCausalLM

    path = quantized("W8A16")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine.from_pretrained(path, dtype="float32")
    prompts = _prompts(8)
    ours = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    for prompt, got in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        assert got == want[0, len(prompt) :].tolist()


def test_fp8_block_checkpoint_matches_transformers_on_its_dequantized_weights(
    tiny_model_dir: Path, quantized
):
    """fp8 weights on a CPU run dequantized: the float model holding exactly those weights
    (in transformers) gives the same greedy tokens."""
    from transformers import AutoModelForCausalLM

    from pdserve.kernels import quant_reference as R

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                q, block_scale = R.quantize_weight_blocks(module.weight, 128)
                rows = block_scale.repeat_interleave(128, 0)[: q.shape[0]]
                module.weight.copy_(R.dequantize_weight(q, rows))
    engine = LLMEngine.from_pretrained(quantized("FP8_HF_BLOCK"), dtype="float32")
    prompts = _prompts(8)
    ours = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
        assert got == want[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("method", "kind", "bound"),
    [
        ("int8", "int8 (w8a8)", 0.8),
        ("int8-weight-only", "int8 (weight-only)", 0.85),
        ("fp8", "float8_e4m3", 0.5),
    ],
)
def test_quantizes_a_float_checkpoint_at_load(
    tiny_model_dir: Path, float_first_tokens, method, kind, bound
):
    engine = LLMEngine.from_pretrained(tiny_model_dir, dtype="float32", quantization=method)
    assert weight_dtype_of(engine.runner.model) == kind
    agreement = _first_token_agreement(engine, float_first_tokens)
    assert agreement >= bound, f"{method}: first tokens agree with float32 on {agreement:.0%}"


def test_at_load_quantization_of_a_quantized_checkpoint_is_refused(quantized):
    with pytest.raises(ValueError, match="already quantized"):
        LLMEngine.from_pretrained(quantized("FP8_HF_BLOCK"), quantization="int8")


@needs_ct
@pytest.mark.parametrize(
    ("scheme", "at_load", "first_only"),
    [("FP8_DYNAMIC", None, False), ("W8A8", None, True), (None, "int8-weight-only", False)],
)
def test_tensor_parallel_quantized_matches_one_rank(
    tiny_model_dir: Path, quantized, scheme: str | None, at_load: str | None, first_only: bool
):
    """Scales are sharded with their weight rows: two ranks give one rank's tokens."""
    path = quantized(scheme) if scheme else tiny_model_dir
    prompts = _prompts(6)
    outs = {}
    for tp in (1, 2):
        engine = LLMEngine(
            EngineConfig(
                model=str(path),
                device="cpu",
                dtype="float32",
                tensor_parallel_size=tp,
                quantization=at_load,
            )
        )
        try:
            outs[tp] = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        finally:
            engine.shutdown()
    # Row-parallel layers sum partial products in another order: allow a rare near-tie
    # flip, not a broken shard. W8A8 quantizes each rank's slice of a row-parallel input
    # with its own per-token scale, so only the first tokens are compared there.
    if first_only:
        outs = {tp: [o[:1] for o in out] for tp, out in outs.items()}
    same = sum(a == b for a, b in zip(outs[1], outs[2], strict=True))
    assert same >= len(prompts) - 1, (outs[1], outs[2])


def test_app_config_model_quantization_reaches_both_pools():
    from pdserve.deployments.config import AppConfig
    from pdserve.deployments.engine_factory import engine_config

    model = {"quantization": "int8-weight-only", "quantize_lm_head": True}
    cfg = AppConfig.from_dict({"model": model})
    for role in ("prefill", "decode"):
        engine = engine_config(cfg, role, "/models/m")
        assert engine.quantization == "int8-weight-only" and engine.quantize_lm_head
    with pytest.raises(ValueError, match="quantization"):
        AppConfig.from_dict({"model": {"quantization": "int4"}})


@pytest.mark.parametrize("method", [None, "int8-weight-only"])
def test_quantize_lm_head_changes_only_the_heads_rounding(tiny_model_dir: Path, method):
    base = LLMEngine.from_pretrained(tiny_model_dir, dtype="float32", quantization=method)
    engine = LLMEngine.from_pretrained(
        tiny_model_dir, dtype="float32", quantization=method, quantize_lm_head=True
    )
    assert getattr(engine.runner.model.lm_head, "weight_dtype", None) == "int8 (weight-only)"
    want = [o.token_ids[0] for o in base.generate(_prompts(), FIRST)]
    agreement = _first_token_agreement(engine, want)
    assert agreement >= 0.9, f"int8 lm_head: first tokens agree on {agreement:.0%}"


def test_quantize_lm_head_is_cpu_only_for_now(tiny_model_dir: Path):
    with pytest.raises(ValueError, match="quantize_lm_head"):
        EngineConfig(model=str(tiny_model_dir), device="cuda", quantize_lm_head=True)
