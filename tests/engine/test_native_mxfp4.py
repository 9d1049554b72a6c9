"""gpt-oss's MXFP4 checkpoints (the released models' format) on the native path.

A tiny random gpt-oss built by transformers (as in ``test_native_gpt_oss.py``) is written
in MXFP4 (``engine/testmodel_quant.quantize_mxfp4``: e2m1 values in blocks of 32 with an
e8m0 scale, the experts only) and served natively with its experts dequantized at load.
The oracle is transformers' own load of that MXFP4 checkpoint (``Mxfp4Config(dequantize=
True)``, its CPU path): greedy tokens equal and logprobs within 1e-4 in float32 on the
default schedule and on the chunked-prefill/preemption one, and with experts split over two
tensor-parallel ranks; a bfloat16 engine holds exactly transformers' dequantized experts and
agrees on the first tokens. The packer round-trips through transformers' dequantizer, and a
malformed checkpoint is refused naming the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.expert_quant import dequantize_mxfp4
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model_config
from pdserve.engine.testmodel_quant import quantize_mxfp4, write_quantized
from pdserve.kernels import moe_ops
from tests.engine.quantized_checkpoints import (
    check_default_schedule,
    check_small_pool,
    check_two_ranks,
    edited_checkpoint,
)
from tests.engine.tiny_hf_models import build_tiny_model
from tests.engine.transformers_reference import (
    Reference,
    assert_bf16_first_tokens_agree,
)

NUM_NEW = 16
OVERRIDES = {"swiglu_limit": 1.5}  # the clamps bite on the tiny model's values
BLOCKS = "model.layers.0.mlp.experts.gate_up_proj_blocks"


def _mxfp4_reference(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model of an MXFP4 checkpoint, experts dequantized on the CPU."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    config = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, quantization_config=config
    ).eval()


@pytest.fixture(scope="module")
def mxfp4(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Reference]:
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    float_dir = build_tiny_model("gpt-oss", root / "float", tiny_model_dir, **OVERRIDES)
    model_dir = write_quantized("MXFP4", float_dir, root / "mxfp4")
    hf = _mxfp4_reference(model_dir, torch.float32)
    return model_dir, Reference(hf, hf.config.vocab_size)


def test_packer_round_trips_through_transformers_dequantizer() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 96, generator=g) * torch.logspace(-6, 2, 40)[:, None]
    w[0, 0] = 0.0  # an all-zero block
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 40, 3, 16) and scales.shape == (3, 40, 3)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    # Round to nearest: within half of e2m1's widest step (2 between 4 and 6) times the scale.
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert ((theirs - w).abs() <= step).all()
    assert torch.equal(theirs[0, 0], torch.zeros(96))
    # The dequantized values are MXFP4 values: packing them again loses nothing.
    again = convert_moe_packed_tensors(*quantize_mxfp4(theirs), dtype=torch.float32)
    assert torch.equal(again.transpose(1, 2), theirs)


def test_dequantizer_equals_transformers_on_every_code_and_scale() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 64, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (2, 64, 4), dtype=torch.uint8, generator=g)
    blocks[0, 0, 0] = torch.arange(0, 256, 16, dtype=torch.uint8) | torch.arange(16).byte()
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, dtype, "t")
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        assert ours.dtype == dtype and torch.equal(ours, theirs)


def test_config_reads_mxfp4_experts_and_float_linears(mxfp4) -> None:
    cfg = load_model_config(mxfp4[0])
    assert cfg.impl == "native" and cfg.moe is not None
    assert cfg.moe.quantized is not None and cfg.moe.quantized.method == "mxfp4"
    assert cfg.quantization is None  # attention and router are float in this format


def test_default_schedule_matches_transformers(mxfp4) -> None:
    check_default_schedule(*mxfp4, NUM_NEW)


def test_chunked_prefill_and_preemption_match_transformers(mxfp4) -> None:
    check_small_pool(*mxfp4, NUM_NEW)


def test_experts_split_over_two_ranks_match_transformers(mxfp4) -> None:
    check_two_ranks(*mxfp4, NUM_NEW)


def test_bfloat16_engine_holds_transformers_experts_and_agrees(
    mxfp4, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MXFP4 values are exact in bfloat16: the engine's experts equal transformers'
    bfloat16 dequantization bit for bit (read before the CPU packs them for oneDNN, which
    frees the stacked copy); the first greedy tokens agree with float32 (packed)."""
    model_dir, ref = mxfp4
    with monkeypatch.context() as m:
        m.setattr(moe_ops, "can_pack", lambda *args: False)
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16"))
    hf = _mxfp4_reference(model_dir, torch.bfloat16)
    for ours, theirs in zip(engine.runner.model.model.layers, hf.model.layers, strict=True):
        gate_up = theirs.mlp.experts.gate_up_proj  # [E, H, 2I], gate and up interleaved
        assert torch.equal(ours.mlp.w13, torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], -1).mT)
        assert torch.equal(ours.mlp.w2, theirs.mlp.experts.down_proj.mT)
    assert engine.dtypes()[0] == "bfloat16; experts mxfp4 dequantized to bfloat16"
    assert_bf16_first_tokens_agree(str(model_dir), ref)


def _drop_scales(t: dict[str, torch.Tensor]) -> None:
    del t[BLOCKS.replace("_blocks", "_scales")]


def _blocks_of_8_bytes(t: dict[str, torch.Tensor]) -> None:
    t[BLOCKS] = t[BLOCKS].reshape(*t[BLOCKS].shape[:2], -1, 8)


def _scales_per_16(t: dict[str, torch.Tensor]) -> None:
    scales = BLOCKS.replace("_blocks", "_scales")
    t[scales] = t[scales].repeat_interleave(2, -1)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop_scales, f"{BLOCKS}' has no 'scales'"),
        (_blocks_of_8_bytes, f"{BLOCKS}': MXFP4 blocks must be"),
        (_scales_per_16, f"{BLOCKS}': scales .* do not match blocks"),
    ],
)
def test_malformed_checkpoint_is_refused_naming_the_tensor(
    mxfp4, tmp_path: Path, edit, message: str
) -> None:
    bad = edited_checkpoint(mxfp4[0], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(bad)))


def test_mxfp4_tensors_without_the_mxfp4_config_are_refused(mxfp4, tmp_path: Path) -> None:
    bad = edited_checkpoint(mxfp4[0], tmp_path / "bad", lambda t: None)
    config = json.loads((bad / "config.json").read_text())
    del config["quantization_config"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\.experts\.\w+_proj_blocks' is MXFP4"):
        LLMEngine(EngineConfig(model=str(bad)))


def test_transformers_path_refuses_mxfp4_naming_the_method(mxfp4) -> None:
    with pytest.raises(ValueError, match="quant_method 'mxfp4' is read only for gpt-oss"):
        load_model_config(mxfp4[0], "transformers")


def test_mxfp4_writer_refuses_a_model_without_stacked_experts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="has no stacked experts"):
        write_quantized("MXFP4", tiny_model_dir, tmp_path / "llama-mxfp4")
    assert not (tmp_path / "llama-mxfp4").exists()
