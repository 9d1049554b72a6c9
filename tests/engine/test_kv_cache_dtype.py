"""An int8 / float8 KV cache through the engine: the pool's dtype and block count, the
scales (calibrated, or the checkpoint's), and greedy tokens close to the float cache's."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.engine import model_runner
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _prompts(n: int = 16, length: int = 40) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(4, 2000) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def float_tokens(tiny_model_dir: Path) -> list[list[int]]:
    engine = LLMEngine.from_pretrained(tiny_model_dir, dtype="float32", num_kv_blocks=256)
    return [o.token_ids for o in engine.generate(_prompts(), GREEDY)]


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_kv_pool_holds_twice_the_blocks_of_bf16(tiny_model_dir, monkeypatch, kv):
    # A budget-bound CPU pool: 64 MiB of "available" memory, more sequences than it holds.
    monkeypatch.setattr(model_runner, "_available_memory_bytes", lambda: 64 << 20)
    counts = {}
    for dtype in ("auto", kv):
        config = EngineConfig(
            model=str(tiny_model_dir), dtype="bfloat16", kv_cache_dtype=dtype, max_num_seqs=512
        )
        runner = ModelRunner(config)
        counts[dtype] = runner.profile_num_blocks()
        pool = runner.allocate_kv_cache(counts[dtype])
        assert pool.dtype == (torch.bfloat16 if dtype == "auto" else runner.kv_dtype)
        assert pool.element_size() == (2 if dtype == "auto" else 1)
    assert counts[kv] == 2 * counts["auto"], counts


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_greedy_tokens_over_a_quantized_kv_cache_stay_close_to_float(
    tiny_model_dir, float_tokens, kv
):
    engine = LLMEngine.from_pretrained(
        tiny_model_dir, dtype="float32", kv_cache_dtype=kv, num_kv_blocks=256
    )
    scales = engine.runner.kv_scales
    assert scales is not None and scales.shape == (4, 2, 2) and bool((scales > 0).all())
    outs = [o.token_ids for o in engine.generate(_prompts(), GREEDY)]
    first = sum(o[0] == f[0] for o, f in zip(outs, float_tokens, strict=True)) / len(outs)
    same = sum(o == f for o, f in zip(outs, float_tokens, strict=True)) / len(outs)
    # Measured on the tiny model (random weights, many near-ties; docs/quantization.md):
    # 14 of 16 first tokens for both; all 6 tokens in 10 (int8) and 5 (e4m3, 3 mantissa
    # bits) of 16. A cache read back wrong agrees on next to nothing.
    assert first >= 0.8, (first, same)
    assert same >= (0.5 if kv == "int8" else 0.25), (first, same)
    # Prefix-cache hits read the quantized blocks back: same tokens the second time.
    again = [o.token_ids for o in engine.generate(_prompts(), GREEDY)]
    assert again == outs


def test_fp8_cache_takes_the_checkpoints_kv_scales(tiny_model_dir, tmp_path):
    model = tmp_path / "with-kv-scales"
    shutil.copytree(tiny_model_dir, model)
    scales = {}
    for i in range(4):
        scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01 * (i + 1))
        scales[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.02, 0.03])  # per head
    save_file(scales, str(model / "kv-scales.safetensors"))
    engine = LLMEngine.from_pretrained(model, kv_cache_dtype="fp8_e4m3", num_kv_blocks=64)
    got = engine.runner.kv_scales
    assert got is not None
    assert torch.allclose(got[2, 0], torch.tensor([0.03, 0.03]))
    assert torch.allclose(got[1, 1], torch.tensor([0.02, 0.03]))
    # The float cache ignores them; an int8 cache calibrates its own.
    assert LLMEngine.from_pretrained(model, num_kv_blocks=64).runner.kv_scales is None


def test_calibrated_scales_are_the_same_in_every_replica(tiny_model_dir):
    runs = [
        ModelRunner(EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="int8")).kv_scales
        for _ in range(2)
    ]
    assert runs[0] is not None and runs[1] is not None
    assert torch.equal(runs[0], runs[1])


def test_quantized_kv_with_tensor_parallelism_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'.*tensor_parallel_size=2"):
        EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="int8", tensor_parallel_size=2)
