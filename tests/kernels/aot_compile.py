"""Compile the Triton kernels for an sm_90 GPU without one (run as a subprocess).

The interpreter checks what the kernels compute but not that they compile: type rules,
``tl.dot`` shapes, loop-carried types and shared-memory use are only checked by the real
compiler. ``triton.compile`` with an explicit target runs the whole pipeline down to a cubin
(ptxas ships in the triton wheel), no driver needed. Usage:
``python -m tests.kernels.aot_compile`` (exit 1 and the error if a kernel fails to compile);
``--registers`` adds ptxas's registers and spills per kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module defines its kernels

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pdserve.kernels.triton import (  # noqa: E402
    activation,
    decode,
    kv,
    mla_decode,
    mla_prefill,
    moe,
    norm,
    prefill,
    rotary,
)

TARGET = GPUTarget("cuda", 90, 32)
TORCH_CUDA = torch.device("cuda")  # only read for its type: no GPU is touched
# Shared memory per block on an H100/H200 (227 KB).
MAX_SHARED = 232448


def _compile(kernel, types: dict[str, str], consts: dict, num_warps: int):  # type: ignore[no-untyped-def]
    """Compile with unlisted arguments as i32 scalars; returns the compiled kernel."""
    signature = {name: types.get(name, "i32") for name in kernel.arg_names}
    signature.update(dict.fromkeys(consts, "constexpr"))
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=consts),
        target=TARGET,
        options={"num_warps": num_warps},
    )
    return compiled


def _registers(ptx: str) -> str:
    """ptxas's report of registers and spills for one kernel's PTX."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", os.devnull]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line.split(":", 1)[-1].strip() for line in result.stderr.splitlines()]
    return "; ".join(line for line in lines if "registers" in line or "spill" in line)


def _cases():  # type: ignore[no-untyped-def]
    bf16 = "*bf16"
    attn = {"k_cache_ptr": bf16, "v_cache_ptr": bf16, "q_ptr": bf16, "scale_log2": "fp32"}
    index = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32"}
    decode_consts = {
        "GROUP": 4,
        "GROUP_PAD": 16,
        "HEAD_DIM": 128,
        "BLOCK_D": 128,
        "BLOCK_SIZE": 16,
        "BLOCK_N": 64,
        "DOT_PRECISION": None,
        "QUANT": False,
    }
    for splits in (1, 4):
        yield (
            f"decode splits={splits}",
            decode._decode_split_kernel,
            {**attn, **index, "out_ptr": bf16 if splits == 1 else "*fp32", "lse_ptr": "*fp32"},
            {**decode_consts, "SPLITS": splits},
            4,
        )
    yield (
        "decode reduce",
        decode._decode_reduce_kernel,
        {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": bf16},
        {"SPLITS": 4, "SPLITS_PAD": 4, "HEAD_DIM": 128, "BLOCK_D": 128},
        4,
    )
    prefill_types = {
        **attn,
        **index,
        "out_ptr": bf16,
        "sinks_ptr": "*fp32",
        "softcap_in": "fp32",
        "softcap_out": "fp32",
    }
    prefill_consts = {
        "GROUP": 4,
        "GROUP_PAD": 4,
        "BLOCK_Q": 32,
        "BLOCK_M": 128,
        "BLOCK_N": 64,
        "HEAD_DIM": 128,
        "BLOCK_D": 128,
        "BLOCK_SIZE": 16,
        "DOT_PRECISION": None,
        "QUANT": False,
    }
    # DeepSeek-V3's MLA: 16 query heads per call (engine/models/deepseek_v3.py) on one
    # 576-wide latent head, with the tiles the launchers pick for it.
    mla = {"GROUP": 16, "GROUP_PAD": 16, "HEAD_DIM": 576, "BLOCK_D": 1024}
    yield (
        "decode MLA latent head",
        decode._decode_split_kernel,
        {**attn, **index, "out_ptr": "*fp32", "lse_ptr": "*fp32"},
        {**decode_consts, **mla, "SPLITS": 4},
        4,
    )
    # The MLA decode kernel at DeepSeek-V3's widths (latent 512 + rope 64), the tiles the
    # launcher picks; bf16 and an int8 / float8 latent cache.
    mla_types = {"q_ptr": bf16, "cache_ptr": bf16, "block_tables_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "lse_ptr": "*fp32", "kv_scale_ptr": "*fp32",
                 "scale_log2": "fp32"}  # fmt: skip
    mla_consts = {
        "LATENT": 512,
        "ROPE": 64,
        "BLOCK_H": mla_decode.BLOCK_H,
        "BLOCK_SIZE": 16,
        "BLOCK_N": mla_decode.BLOCK_N,
        "DOT_PRECISION": None,
        "QUANT": False,
    }
    for splits in (1, 4):
        yield (f"MLA decode kernel splits={splits}", mla_decode._mla_decode_kernel,
               {**mla_types, "out_ptr": bf16 if splits == 1 else "*fp32"},
               {**mla_consts, "SPLITS": splits}, 4)  # fmt: skip
    for cache in ("*i8", "*fp8e4nv"):
        yield (f"MLA decode kernel, {cache} latent", mla_decode._mla_decode_kernel,
               {**mla_types, "cache_ptr": cache, "out_ptr": "*fp32"},
               {**mla_consts, "SPLITS": 4, "QUANT": True}, 4)  # fmt: skip
    # The MLA prefill kernel at the same widths: the launcher's tiles for 128 heads (64 x 1
    # token), 32 heads (32 x 2) and 16 heads (16 x 4); int8 / float8 latents at 64 x 1; a
    # float32 query and latent at 128 heads (32 x 1).
    prefill_mla_types = {**mla_types, "cu_seqlens_q_ptr": "*i32", "out_ptr": bf16}
    prefill_mla_consts = {**mla_consts, "BLOCK_N": mla_prefill.BLOCK_N}

    def prefill_mla_tile(heads: int, dtype: torch.dtype) -> tuple[dict[str, object], int]:
        block_h, block_q, warps = mla_prefill.tile_config(heads, dtype, TORCH_CUDA)
        return {**prefill_mla_consts, "BLOCK_H": block_h, "BLOCK_Q": block_q}, warps

    for heads in (128, 32, 16):
        consts, warps = prefill_mla_tile(heads, torch.bfloat16)
        yield (f"MLA prefill kernel {consts['BLOCK_H']} heads x {consts['BLOCK_Q']} tokens",
               mla_prefill._mla_prefill_kernel, prefill_mla_types, consts, warps)  # fmt: skip
    consts, warps = prefill_mla_tile(128, torch.bfloat16)
    for cache in ("*i8", "*fp8e4nv"):
        yield (f"MLA prefill kernel, {cache} latent", mla_prefill._mla_prefill_kernel,
               {**prefill_mla_types, "cache_ptr": cache}, {**consts, "QUANT": True},
               warps)  # fmt: skip
    consts, warps = prefill_mla_tile(128, torch.float32)
    fp32 = dict.fromkeys(("q_ptr", "cache_ptr", "out_ptr"), "*fp32")
    yield ("MLA prefill kernel, float32", mla_prefill._mla_prefill_kernel,
           {**prefill_mla_types, **fp32}, {**consts, "DOT_PRECISION": "ieee"}, warps)  # fmt: skip
    no_variants = {"HAS_SOFTCAP": False, "HAS_WINDOW": False, "HAS_SINKS": False}
    yield (
        "prefill MLA latent head",
        prefill._prefill_kernel,
        prefill_types,
        {**prefill_consts, **mla, **no_variants, "BLOCK_Q": 4, "BLOCK_M": 64, "BLOCK_N": 16},
        4,
    )
    variants = {"plain": False, "window+softcap+sinks": True}  # Gemma 2/3, gpt-oss
    for name, variant in variants.items():
        flags = {"HAS_SOFTCAP": variant, "HAS_WINDOW": variant, "HAS_SINKS": variant}
        yield (f"prefill {name}", prefill._prefill_kernel, prefill_types,
               {**prefill_consts, **flags}, 8)  # fmt: skip
    write_types = {
        "key_ptr": bf16,
        "value_ptr": bf16,
        "k_cache_ptr": bf16,
        "v_cache_ptr": bf16,
        "slot_ptr": "*i64",
    }
    write_consts = {"NUM_HEADS": 8, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128}
    plain_write = {"QUANT": False, "QMAX": 1.0, "ROUND": False, "HAS_VALUE": True}
    yield ("write_kv", kv._write_kv_kernel, write_types, {**write_consts, **plain_write}, 4)
    one_plane = {**write_consts, **plain_write, "NUM_HEADS": 1, "BLOCK_H": 1, "HEAD_DIM": 576,
                 "BLOCK_D": 1024, "HAS_VALUE": False}  # fmt: skip
    yield ("write_kv one plane (MLA latent)", kv._write_kv_kernel, write_types, one_plane, 4)
    # An int8 / float8 KV cache (kernels.kv_quant): quantizing write, dequantizing attention.
    for cache in ("*i8", "*fp8e4nv"):
        quant = {"k_cache_ptr": cache, "v_cache_ptr": cache, "k_scale_ptr": "*fp32",
                 "v_scale_ptr": "*fp32"}  # fmt: skip
        yield (f"decode {cache} cache", decode._decode_split_kernel,
               {**attn, **index, **quant, "out_ptr": "*fp32", "lse_ptr": "*fp32"},
               {**decode_consts, "SPLITS": 4, "QUANT": True}, 4)  # fmt: skip
        flags = {"HAS_SOFTCAP": True, "HAS_WINDOW": True, "HAS_SINKS": False, "QUANT": True}
        yield (f"prefill {cache} cache, window+softcap", prefill._prefill_kernel,
               {**prefill_types, **quant}, {**prefill_consts, **flags}, 8)  # fmt: skip
        int8 = cache == "*i8"
        q_write = {"QUANT": True, "QMAX": 127.0 if int8 else 448.0, "ROUND": int8,
                   "HAS_VALUE": True}  # fmt: skip
        yield (f"write_kv into {cache}", kv._write_kv_kernel, {**write_types, **quant},
               {**write_consts, **q_write}, 4)  # fmt: skip
    for gather in (True, False):
        yield (
            f"copy_blocks gather={gather}",
            kv._copy_blocks_kernel,
            {
                "src_ptr": bf16,
                "dst_ptr": bf16,
                "block_ids_ptr": "*i64",
                "stride_src_p": "i64",
                "stride_dst_p": "i64",
            },  # fmt: skip
            {"GATHER": gather, "CHUNK": 2048},
            4,
        )
    yield (
        "rms_norm",
        norm._rms_norm_kernel,
        {
            "x_ptr": bf16,
            "residual_ptr": bf16,
            "weight_ptr": bf16,
            "out_ptr": bf16,
            "residual_out_ptr": bf16,
            "eps": "fp32",
        },  # fmt: skip
        {"HAS_RESIDUAL": True, "BLOCK_H": 4096},
        16,
    )
    yield (
        "rotary",
        rotary._rotary_kernel,
        {
            "positions_ptr": "*i64",
            "q_ptr": bf16,
            "k_ptr": bf16,
            "cos_sin_ptr": "*fp32",
            "q_out_ptr": bf16,
            "k_out_ptr": bf16,
        },  # fmt: skip
        {
            "NUM_Q_HEADS": 32,
            "NUM_K_HEADS": 8,
            "HALF": 64,
            "BLOCK_HQ": 32,
            "BLOCK_HK": 8,
            "BLOCK_HALF": 64,
        },  # fmt: skip
        4,
    )
    # gate/up (bf16 out), then down (weighted, fp32 out); with expert biases (gpt-oss) or not.
    moe_types = dict.fromkeys(("a_ptr", "w_ptr", "bias_ptr"), bf16)
    moe_types.update(route_w_ptr="*fp32", sorted_ids_ptr="*i32", block_expert_ptr="*i32")
    for mul_weight in (False, True):
        for has_bias in (False, True):
            yield (
                f"moe_gemm mul_weight={mul_weight} bias={has_bias}",
                moe._moe_gemm_kernel,
                {**moe_types, "out_ptr": "*fp32" if mul_weight else bf16},
                {
                    "K": 768 if mul_weight else 2048,
                    "A_DIV": 1 if mul_weight else 8,
                    "HAS_BIAS": has_bias,
                    "MUL_WEIGHT": mul_weight,
                    "BLOCK_M": 64,
                    "BLOCK_N": moe.BLOCK_N,
                    "BLOCK_K": moe.BLOCK_K,
                    "DOT_PRECISION": None,
                },
                4,
            )
    for clamped in (False, True):  # SiLU-and-mul, gpt-oss's clamped SwiGLU
        yield (
            f"gated_activation clamped={clamped}",
            activation._gated_activation_kernel,
            {"x_ptr": bf16, "out_ptr": bf16, "alpha": "fp32", "limit": "fp32"},
            {"CLAMPED": clamped, "BLOCK": 1024},
            4,
        )


def main(argv: list[str]) -> int:
    failed = 0
    for name, kernel, types, consts, warps in _cases():
        try:
            compiled = _compile(kernel, types, consts, warps)
        except Exception as exc:  # report every kernel, not just the first failure
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            failed += 1
            continue
        shared = int(compiled.metadata.shared)
        status = "ok" if shared <= MAX_SHARED else "FAIL (shared memory)"
        failed += status != "ok"
        print(f"{status} {name}: {shared} B shared")
        if "--registers" in argv:
            print(f"   {_registers(compiled.asm['ptx'])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
