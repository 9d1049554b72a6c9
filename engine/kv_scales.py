"""The KV cache's dtype and, for an int8 / float8 cache, its per-layer per-head scales.

``EngineConfig.kv_cache_dtype`` picks the pool's element type. A quantized pool needs one
float32 scale per layer, K or V, and KV head (``[L, 2, Hkv]``), fixed for the engine's life
so that every block of the pool, the prefix cache and the KV hand-off mean the same thing
(an MLA pool's one plane is read as both K and V: its K and V scales are equal):

- a float8 cache takes the checkpoint's ``model.layers.<i>.self_attn.k_scale`` / ``v_scale``
  where it has them (vLLM's and compressed-tensors' per-tensor KV scales, broadcast over the
  heads);
- otherwise (and always for int8) the scales are calibrated at load: one forward pass of a
  fixed token sequence into a float pool, each layer's and head's largest |K| and |V| times
  a headroom, over the type's largest value. The sequence depends only on the vocabulary,
  so every replica of one checkpoint calibrates the same scales.

Why these choices, and what they cost in accuracy: docs/quantization.md. This module never
allocates the serving pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.kernels.ops import is_quantized_kv, kv_qmax

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
}
# Calibrated max |x| times this becomes the type's largest value: values past what the
# calibration saw clamp only beyond it. int8 pays for headroom with resolution (a linear
# grid), e4m3 hardly (a float grid; only values 2**-6 below the top lose bits).
_HEADROOM = {torch.int8: 1.5, torch.float8_e4m3fn: 4.0}
_CALIBRATION_TOKENS = 512


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for ``EngineConfig.kv_cache_dtype``."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r} is not one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


def kv_dtype_label(dtype: torch.dtype) -> str:
    """The config's spelling of a pool dtype ('int8', 'fp8_e4m3', else torch's name)."""
    for name, d in KV_CACHE_DTYPES.items():
        if d == dtype:
            return name
    return str(dtype).removeprefix("torch.")


def checkpoint_kv_scales(
    model_dir: str, num_layers: int, kv_heads: range
) -> torch.Tensor | None:  # [L, 2, Hkv] float32
    """The checkpoint's ``self_attn.k_scale`` / ``v_scale`` of every layer (scalars or one
    per KV head; this rank's ``kv_heads``), or None when it has none. ValueError when only
    some layers have them."""
    from safetensors import safe_open

    from pdserve.engine.loader import safetensors_files

    found: dict[tuple[int, int], torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                parts = name.split(".")
                kv_scale = parts[-1] in ("k_scale", "v_scale") and parts[-2] == "self_attn"
                if len(parts) == 5 and kv_scale:
                    found[(int(parts[2]), parts[-1] == "v_scale")] = f.get_tensor(name).float()
    if not found:
        return None
    if len(found) != 2 * num_layers:
        raise ValueError(
            f"{model_dir}: the checkpoint has k_scale/v_scale for {len(found)} of the "
            f"{2 * num_layers} layer K/V caches; it needs them for all or none"
        )
    out = torch.empty(num_layers, 2, len(kv_heads))
    for (layer, is_v), t in found.items():
        t = t.reshape(-1)
        out[layer, int(is_v)] = t[0] if t.numel() == 1 else t[kv_heads.start : kv_heads.stop]
    return out


def calibration_step(
    vocab_size: int, num_tokens: int, block_size: int
) -> tuple[SchedulerOutput, int]:
    """One prompt of ``num_tokens`` tokens spread over the vocabulary (a fixed sequence)
    in blocks ``0..n-1``; returns it and ``n``."""
    ids = [(i * 7919 + 17) % vocab_size for i in range(num_tokens)]
    blocks = -(-num_tokens // block_size)
    chunk = ScheduledChunk(
        request_id="kv-scale-calibration",
        token_ids=ids,
        start_position=0,
        block_ids=list(range(blocks)),
        sample=True,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
        num_output_tokens=0,
    )
    return SchedulerOutput([chunk], num_tokens), blocks


@torch.inference_mode()
def calibrate_kv_scales(runner: ModelRunner, kv_dtype: torch.dtype) -> torch.Tensor:
    """``[L, P, Hkv]`` float32 scales (P the pool's planes) from one forward pass of the
    calibration prompt into a throwaway float pool of every layer (the runner's pools,
    window plan, scales and connector are restored)."""
    num_tokens = min(_CALIBRATION_TOKENS, runner.max_model_len)
    step, blocks = calibration_step(
        runner.model_config.vocab_size, num_tokens, runner.config.block_size
    )
    saved = runner.kv_cache, runner.kv_scales, runner.kv_connector
    saved_window = runner.window_layout, runner.window_kv_cache
    runner.kv_scales, runner.kv_connector = None, None
    runner.window_layout, runner.window_kv_cache = None, None  # one pool: L rows of scales
    shape = list(runner.kv_cache_shape(blocks))
    runner.kv_cache = torch.zeros(shape, dtype=runner.model_config.dtype, device=runner.device)
    try:
        runner.compute_logits(step)
        pool = runner.kv_cache
        # [L, P, N, B, H, D] -> max over blocks, offsets and dims.
        absmax = pool.float().abs().amax(dim=(2, 3, 5))
    finally:
        runner.kv_cache, runner.kv_scales, runner.kv_connector = saved
        runner.window_layout, runner.window_kv_cache = saved_window
    return (absmax.clamp(min=1e-4) * _HEADROOM[kv_dtype] / kv_qmax(kv_dtype)).contiguous()


def resolve_kv_scales(runner: ModelRunner, kv_dtype: torch.dtype) -> torch.Tensor | None:
    """The scales the runner's pool uses (on its device), or None for a float pool."""
    if not is_quantized_kv(kv_dtype):
        return None
    scales = None
    if kv_dtype == torch.float8_e4m3fn:
        c = runner.model_config
        scales = checkpoint_kv_scales(runner.config.model, c.num_layers, runner.kv_heads)
    if scales is None:
        scales = calibrate_kv_scales(runner, kv_dtype)
    if runner.model_config.kv_planes == 1:
        # One plane is both K and V (MLA's latent): one scale serves both reads.
        scales = scales.amax(dim=1, keepdim=True).expand(-1, 2, -1)
    return scales.to(device=runner.device, dtype=torch.float32).contiguous()
