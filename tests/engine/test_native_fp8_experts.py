"""Block-quantized fp8 MoE checkpoints (``quant_method: fp8`` with ``weight_block_size``,
as Qwen3-30B-A3B-FP8 ships) on the native path.

A tiny random Qwen3-MoE built by transformers is written in that format (every attention
and expert projection an e4m3 ``weight`` with a ``weight_scale_inv`` per 32x32 block, so
the experts' scales are 1x2 and 2x1 grids; the router stays float). The native engine holds
the experts dequantized and runs the attention on the dense fp8 path. transformers cannot
load the fp8 checkpoint on this machine (its FineGrainedFP8 loader needs accelerate, even
to dequantize on a CPU), so the oracle is transformers on the float checkpoint of exactly
the dequantized weights: greedy tokens equal and logprobs
within 1e-4 in float32 on both schedules and over two tensor-parallel ranks. An expert
weight without its scales, or with scales of the wrong grid, is refused naming the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.expert_quant import dequantize_fp8_blocks, dequantize_fp8_weights
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model_config
from pdserve.engine.testmodel_quant import write_quantized
from pdserve.kernels import quant_reference as R
from tests.engine.quantized_checkpoints import (
    block_dequantized,
    check_default_schedule,
    check_small_pool,
    check_two_ranks,
    dequantized_copy,
    edited_checkpoint,
)
from tests.engine.tiny_hf_models import build_tiny_model
from tests.engine.transformers_reference import (
    Reference,
    load_reference,
)

NUM_NEW = 16
BLOCK = 32
EXPERT = "model.layers.0.mlp.experts.1.down_proj.weight"


@pytest.fixture(scope="module")
def fp8_moe(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Reference]:
    root = tmp_path_factory.mktemp("qwen3-moe-fp8")
    float_dir = build_tiny_model("qwen3-moe", root / "float", tiny_model_dir)
    model_dir = write_quantized("FP8_HF_BLOCK", float_dir, root / "fp8", fp8_block=BLOCK)
    return model_dir, load_reference(dequantized_copy(model_dir, root / "dequantized", BLOCK))


@pytest.mark.parametrize("shape", [(64, 96), (40, 72)])  # whole blocks, and cut blocks
def test_dequantizer_equals_the_reference(shape: tuple[int, int]) -> None:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    q, block_scale = R.quantize_weight_blocks(w, BLOCK)
    want = block_dequantized(q, block_scale, BLOCK)
    assert (want - w).abs().max() <= 0.07 * w.abs().max()  # e4m3: 3 mantissa bits
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_fp8_blocks(q, block_scale, (BLOCK, BLOCK), dtype, "t")
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))


def test_checkpoint_dequantization_pairs_halves_in_either_order() -> None:
    g = torch.Generator().manual_seed(2)
    q, scale = R.quantize_weight_blocks(torch.randn(40, 72, generator=g), BLOCK)
    norm = torch.ones(8)
    want = block_dequantized(q, scale, BLOCK)
    for order in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
        tensors = [("a.weight", q), ("a.weight_scale_inv", scale), ("n.weight", norm)]
        out = dict(dequantize_fp8_weights([tensors[i] for i in order], (BLOCK, BLOCK)))
        assert sorted(out) == ["a.weight", "n.weight"] and out["n.weight"] is norm
        assert torch.equal(out["a.weight"], want)
    with pytest.raises(ValueError, match="'a.weight_scale_inv' has no 'weight'"):
        list(dequantize_fp8_weights([("a.weight_scale_inv", scale)], (BLOCK, BLOCK)))


def test_config_reads_fp8_block_experts_and_linears(fp8_moe) -> None:
    cfg = load_model_config(fp8_moe[0])
    assert cfg.impl == "native" and cfg.moe is not None
    assert cfg.moe.quantized is not None and cfg.moe.quantized.method == "fp8"
    assert cfg.moe.quantized.block == (BLOCK, BLOCK)
    assert cfg.quantization is not None and cfg.quantization.block == (BLOCK, BLOCK)


def test_reports_show_the_experts_held_dequantized(fp8_moe) -> None:
    engine = LLMEngine(EngineConfig(model=str(fp8_moe[0]), dtype="float32"))
    weights, _ = engine.dtypes()
    assert weights == "fp8 a8 fp8; experts fp8 32x32 blocks dequantized to float32"


def test_default_schedule_matches_transformers(fp8_moe) -> None:
    check_default_schedule(*fp8_moe, NUM_NEW)


def test_blocks_cut_short_by_the_width_match_transformers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """48x48 blocks over 64- and 32-wide inputs: every linear's last block is cut short,
    in attention (the dense fp8 path) and in the experts."""
    float_dir = build_tiny_model("qwen3-moe", tmp_path / "float", tiny_model_dir)
    model_dir = write_quantized("FP8_HF_BLOCK", float_dir, tmp_path / "fp8", fp8_block=48)
    ref = load_reference(dequantized_copy(model_dir, tmp_path / "dequantized", 48))
    check_default_schedule(model_dir, ref, NUM_NEW)


def test_chunked_prefill_and_preemption_match_transformers(fp8_moe) -> None:
    check_small_pool(*fp8_moe, NUM_NEW)


def test_experts_split_over_two_ranks_match_transformers(fp8_moe) -> None:
    check_two_ranks(*fp8_moe, NUM_NEW)


def _drop_scale(t: dict[str, torch.Tensor]) -> None:
    del t[EXPERT + "_scale_inv"]


def _wrong_grid(t: dict[str, torch.Tensor]) -> None:
    t[EXPERT + "_scale_inv"] = t[EXPERT + "_scale_inv"].repeat(1, 2)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop_scale, f"{EXPERT}' has no 'weight_scale_inv'"),
        (_wrong_grid, f"{EXPERT}': weight_scale_inv \\(2, 2\\), expected \\(2, 1\\)"),
    ],
)
def test_malformed_expert_is_refused_naming_the_tensor(
    fp8_moe, tmp_path: Path, edit, message: str
) -> None:
    bad = edited_checkpoint(fp8_moe[0], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(bad)))


def test_fp8_experts_without_block_size_are_refused(fp8_moe, tmp_path: Path) -> None:
    bad = edited_checkpoint(fp8_moe[0], tmp_path / "bad", lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    del config["quantization_config"]["weight_block_size"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="fp8 experts are read with a weight_block_size"):
        load_model_config(bad)


@pytest.fixture(scope="module")
def fp8_deepseek(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Reference]:
    """A tiny DeepSeek-V3 in the released checkpoint's format: every linear of attention
    (q/kv LoRA, kv_b, o), dense MLP, shared and routed experts fp8 in 32x32 blocks (cut
    short where a dimension is not a multiple), router float."""
    root = tmp_path_factory.mktemp("deepseek-v3-fp8")
    float_dir = build_tiny_model("deepseek-v3", root / "float", tiny_model_dir)
    model_dir = write_quantized("FP8_HF_BLOCK", float_dir, root / "fp8", fp8_block=BLOCK)
    return model_dir, load_reference(dequantized_copy(model_dir, root / "dequantized", BLOCK))


def test_deepseek_v3_fp8_matches_transformers_on_both_schedules(fp8_deepseek) -> None:
    check_default_schedule(*fp8_deepseek, NUM_NEW)
    check_small_pool(*fp8_deepseek, NUM_NEW)


def test_deepseek_v3_fp8_is_reported_dequantized_and_named_when_malformed(
    fp8_deepseek, tmp_path: Path
) -> None:
    engine = LLMEngine(EngineConfig(model=str(fp8_deepseek[0]), dtype="float32"))
    assert engine.dtypes()[0] == "float32; fp8 32x32 blocks dequantized"
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"

    def drop(t: dict[str, torch.Tensor]) -> None:
        del t[kv_b + "_scale_inv"]

    bad = edited_checkpoint(fp8_deepseek[0], tmp_path / "bad", drop)
    with pytest.raises(ValueError, match=f"{kv_b}' has no 'weight_scale_inv'"):
        LLMEngine(EngineConfig(model=str(bad)))
