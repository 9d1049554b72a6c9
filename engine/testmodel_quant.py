"""Quantized copies of the generated test models, for tests and benchmarks.

``python -m pdserve.engine.testmodel_quant SCHEME SRC_DIR OUT_DIR`` writes a quantized
checkpoint of a float model directory (``engine/testmodel.py``). Data-free schemes only:

- ``W8A8``, ``W8A16``, ``FP8_DYNAMIC``, ``FP8_BLOCK``: compressed-tensors presets, applied
  and compressed by the ``compressed-tensors`` library itself (weight scales from each
  weight's min/max, as llmcompressor's data-free path does), so the files are what the
  field's tools write. Needs the optional ``quant`` extra.
- ``FP8_HF_BLOCK``: the ``quant_method: fp8`` format (float8 weights, 128x128
  ``weight_scale_inv``; every expert's projections too), written with safetensors; needs
  nothing extra.
- ``MXFP4``: a gpt-oss checkpoint in the released models' format (``quant_method: mxfp4``:
  the stacked experts as e2m1 ``*_blocks`` with e8m0 ``*_scales``, everything else float),
  written with safetensors (``quantize_mxfp4``).

Generated on demand and cached by the tests; never committed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from pdserve.kernels.ops import quant_reference as ref

COMPRESSED_TENSORS_SCHEMES = ("W8A8", "W8A16", "FP8_DYNAMIC", "FP8_BLOCK")
SCHEMES = (*COMPRESSED_TENSORS_SCHEMES, "FP8_HF_BLOCK", "MXFP4")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # fmt: skip
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def write_quantized(scheme: str, src: str | Path, out: str | Path, fp8_block: int = 128) -> Path:
    """Write ``src`` quantized with ``scheme`` to ``out`` (atomically) and return it;
    ``fp8_block`` is FP8_HF_BLOCK's scale block."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is unknown; choose from {', '.join(SCHEMES)}")
    out = Path(out)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        if scheme == "FP8_HF_BLOCK":
            _write_fp8_block(Path(src), tmp, fp8_block)
        elif scheme == "MXFP4":
            _write_mxfp4(Path(src), tmp)
        else:
            _write_compressed_tensors(scheme, Path(src), tmp)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                     "special_tokens_map.json"):  # fmt: skip
            if (Path(src) / name).is_file() and not (tmp / name).exists():
                shutil.copy(Path(src) / name, tmp / name)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_compressed_tensors(scheme: str, src: Path, out: Path) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationStrategy,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    preset = preset_name_to_scheme(scheme, ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": preset}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)

    def min_max(w: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
        strategy = args.strategy
        if strategy == QuantizationStrategy.TENSOR:
            return w.amin().reshape(1), w.amax().reshape(1)
        if strategy == QuantizationStrategy.CHANNEL:
            return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        if strategy == QuantizationStrategy.GROUP:
            v = w.reshape(w.shape[0], -1, args.group_size)
            return v.amin(-1), v.amax(-1)
        if strategy == QuantizationStrategy.BLOCK:
            (br, bc), (o, i) = args.block_structure, w.shape
            v = torch.nn.functional.pad(w, (0, -i % bc, 0, -o % br))
            v = v.reshape(-(-o // br), br, -(-i // bc), bc)
            return v.amin((1, 3)), v.amax((1, 3))
        raise ValueError(f"weight strategy {strategy} has no data-free observer here")

    with torch.no_grad():
        for module in model.modules():
            # The linears apply_quantization_config gave a scheme and scale parameters.
            module_scheme = getattr(module, "quantization_scheme", None)
            if not isinstance(module, torch.nn.Linear) or module_scheme is None:
                continue
            if not hasattr(module, "weight_scale"):
                continue
            args = module_scheme.weights
            lo, hi = min_max(module.weight.float(), args)
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(
                module.weight_scale.shape
            )
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                    module.weight_zero_point.shape
                )
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))


def _read_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _write_config(src: Path, out: Path, quantization_config: dict) -> None:
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))


def quantize_mxfp4(
    w: torch.Tensor,  # [..., cols] float, cols a multiple of 32
) -> tuple[torch.Tensor, torch.Tensor]:  # blocks [..., cols / 32, 16], scales [..., cols / 32]
    """MXFP4 of ``w``: per block of 32 values the smallest power of two that brings the
    block's largest magnitude within e2m1's 6, then each value rounded to the nearest e2m1
    code, two codes a byte (low nibble first); scales as e8m0 bytes (exponent + 127)."""
    if w.shape[-1] % 32:
        raise ValueError(f"MXFP4 needs columns in blocks of 32, got {w.shape[-1]}")
    v = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = v.abs().amax(-1)
    exp = torch.ceil(torch.log2(amax.clamp(min=2.0**-127) / 6.0)).clamp(-127, 127)
    scaled = v / torch.exp2(exp).unsqueeze(-1)
    magnitudes = torch.tensor(_E2M1_MAGNITUDES)
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes = codes + 8 * (scaled < 0).long()
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def _write_mxfp4(src: Path, out: Path) -> None:
    from safetensors.torch import save_file

    written: dict[str, torch.Tensor] = {}
    for name, t in _read_tensors(src).items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            # stored [E, in, out]; MXFP4 blocks run along the input of each output row
            blocks, scales = quantize_mxfp4(t.transpose(1, 2))
            written[name + "_blocks"], written[name + "_scales"] = blocks, scales
        else:
            written[name] = t
    if not any(name.endswith("_blocks") for name in written):
        raise ValueError(f"MXFP4 writes gpt-oss checkpoints; {src} has no stacked experts")
    save_file(written, str(out / "model.safetensors"))
    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                     "model.embed_tokens", "lm_head"]  # fmt: skip
    _write_config(src, out, {"quant_method": "mxfp4", "modules_to_not_convert": not_converted})


def _write_fp8_block(src: Path, out: Path, block: int = 128) -> None:
    from safetensors.torch import save_file

    tensors = _read_tensors(src)
    written: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in _LINEARS:
            q, scale = ref.quantize_weight_blocks(t.float(), block)
            written[name] = q
            written[name + "_scale_inv"] = scale
        else:
            written[name] = t
    save_file(written, str(out / "model.safetensors"))
    _write_config(
        src,
        out,
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [block, block],
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scheme", choices=SCHEMES)
    parser.add_argument("src", help="float model directory")
    parser.add_argument("out", help="directory to write (must not exist)")
    parser.add_argument("--fp8-block", type=int, default=128, help="FP8_HF_BLOCK's block")
    args = parser.parse_args()
    print(write_quantized(args.scheme, args.src, args.out, args.fp8_block))


if __name__ == "__main__":
    main()
