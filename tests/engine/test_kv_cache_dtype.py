"""An int8 / float8 KV cache through the engine: the pool's dtype and block count, the
scales (calibrated, or the checkpoint's), and greedy tokens close to the float cache's; the
transformers-backed path and tensor parallelism give the tokens of one native engine with the
same KV dtype."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.engine import model_runner
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_scales import KV_CACHE_DTYPES
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


POOL_CASES = [(kv, impl) for impl in ("native", "transformers") for kv in ("int8", "fp8_e4m3")]


@pytest.mark.parametrize(("kv", "impl"), POOL_CASES, ids=[f"{k}-{i}" for k, i in POOL_CASES])
def test_quantized_kv_pool_holds_twice_the_blocks_of_bf16(tiny_model_dir, monkeypatch, kv, impl):
    # A budget-bound CPU pool: 64 MiB of "available" memory, more sequences than it holds.
    monkeypatch.setattr(model_runner, "_available_memory_bytes", lambda: 64 << 20)
    counts = {}
    for dtype in ("auto", kv):
        config = EngineConfig(
            model=str(tiny_model_dir), dtype="bfloat16", kv_cache_dtype=dtype, max_num_seqs=512,
            model_impl=impl,
        )  # fmt: skip
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


# The tiny Llama, Gemma 2 (sliding window, logit softcap) and gpt-oss (attention sinks).
TRANSFORMERS_CASES = [
    ("llama", "int8"),
    ("llama", "fp8_e4m3"),
    ("gemma2", "int8"),
    ("gpt-oss", "fp8_e4m3"),
]


@pytest.mark.parametrize(
    ("model", "kv"), TRANSFORMERS_CASES, ids=[f"{m}-{k}" for m, k in TRANSFORMERS_CASES]
)
def test_the_transformers_path_quantizes_its_cache_like_the_native_path(
    tiny_model_dir, tmp_path, model, kv
):
    """A model forced onto the transformers path: its attention hook writes and reads the
    quantized pool through the same kernels with scales calibrated the same way, so the
    scales and the greedy tokens are the native path's with the same KV dtype."""
    from tests.engine.tiny_hf_models import build_tiny_model

    model_dir = (
        tiny_model_dir if model == "llama" else build_tiny_model(model, tmp_path, tiny_model_dir)
    )
    runs = {}
    for impl in ("native", "transformers"):
        engine = LLMEngine.from_pretrained(
            model_dir, dtype="float32", kv_cache_dtype=kv, num_kv_blocks=256, model_impl=impl
        )
        assert engine.runner.model_config.impl == impl
        assert engine.kv_cache.dtype == KV_CACHE_DTYPES[kv]
        runs[impl] = (
            engine.runner.kv_scales,
            [o.token_ids for o in engine.generate(_prompts(), GREEDY)],
        )
    (native_scales, native), (hf_scales, hf) = runs["native"], runs["transformers"]
    assert native_scales is not None and hf_scales is not None
    # Measured: scales within 5e-7 relative (float32 summation order), every token equal.
    torch.testing.assert_close(hf_scales, native_scales, rtol=1e-4, atol=0)
    assert hf == native


def test_fp8_cache_takes_the_checkpoints_kv_scales(tiny_model_dir, tmp_path):
    model = _with_kv_scales(tiny_model_dir, tmp_path / "with-kv-scales")
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


def _with_kv_scales(model_dir: Path, dest: Path) -> Path:
    """A copy of ``model_dir`` with per-tensor K and per-head V scales of every layer."""
    shutil.copytree(model_dir, dest)
    scales = {}
    for i in range(4):
        scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01 * (i + 1))
        scales[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.02, 0.03])  # per head
    save_file(scales, str(dest / "kv-scales.safetensors"))
    return dest


TP_CASES = [
    ("int8", False, "native"),
    ("fp8_e4m3", False, "native"),
    ("fp8_e4m3", True, "native"),
    ("int8", False, "transformers"),
    ("fp8_e4m3", True, "transformers"),
]


@pytest.mark.parametrize(
    ("kv", "checkpoint_scales", "impl"),
    TP_CASES,
    ids=[f"{k}-{'checkpoint' if c else 'calibrated'}-{i}" for k, c, i in TP_CASES],
)
def test_tensor_parallel_quantized_kv_gives_the_single_rank_tokens(
    tiny_model_dir, tmp_path, kv, checkpoint_scales, impl
):
    """TP=2 over a quantized cache: each rank holds its KV head's scales (the checkpoint's
    sliced, or calibrated by both ranks in one forward pass), equal to the matching heads
    of TP=1's, and the greedy tokens are TP=1's with the same KV dtype (native TP=1 for
    the transformers path's TP=2 too)."""
    model = _with_kv_scales(tiny_model_dir, tmp_path / "m") if checkpoint_scales else tiny_model_dir
    prompts = _prompts(8)
    runs = {}
    base = EngineConfig(model=str(model), device="cpu", dtype="float32", kv_cache_dtype=kv)
    for tp in (1, 2):
        update = {"tensor_parallel_size": tp, "model_impl": "native" if tp == 1 else impl}
        engine = LLMEngine(base.model_copy(update={**update, "num_kv_blocks": 128}))
        try:
            assert engine.kv_cache.dtype == KV_CACHE_DTYPES[kv]
            scales = engine.runner.rank_kv_scales() if tp > 1 else [engine.kv_scales]
            runs[tp] = [o.token_ids for o in engine.generate(prompts, GREEDY)], scales
        finally:
            engine.shutdown()
    single = runs[1][1][0]
    assert single is not None
    for rank, got in enumerate(runs[2][1]):
        assert got is not None and got.shape == (4, 2, 1), got
        # Both ranks' calibration pass sums their heads' partial products in another order
        # than one rank does: last-bit differences only (the hand-off's tolerance).
        torch.testing.assert_close(got, single[:, :, rank : rank + 1], rtol=1e-4, atol=0)
    if checkpoint_scales:
        assert torch.allclose(runs[2][1][1][:, 1, 0], torch.tensor(0.03))
    assert runs[2][0] == runs[1][0]
