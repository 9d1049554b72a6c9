"""Check and time every Triton kernel on a CUDA GPU: ``python -m pdserve.kernels.triton.gpu_check``.

Each kernel (through ``pdserve.kernels.ops``, as the engine calls it) is compared with its torch
reference on the same device, then timed with ``triton.testing.do_bench``. Speeds are
reported against ceilings measured in the same run, on the same GPU:
  - decode attention (batch 64, context 4k, bf16, Hq 32 / Hkv 8, D 128): bytes of K/V read
    per second as a fraction of a device-to-device copy's bandwidth;
  - prefill attention (8k new tokens): causal attention TFLOP/s as a fraction of a bf16
    matmul's (torch's own SDPA on the same problem is printed for context);
  - block gather/scatter, KV write, RMSNorm, rotary: bandwidth vs the copy;
  - the fused MoE (``gpu_check_moe``): decode as expert bytes per second, prefill TFLOP/s.
The int8 / float8 KV cache (quantizing write, attention over it) is checked too
(``gpu_check_kvquant``), and DeepSeek-V3's MLA decode kernel with the one-plane latent
write, timed against the generic MQA kernel (``gpu_check_mla``).
Prints a table, writes JSON (``--out``), exits 1 if a check fails. Without CUDA it says so
and exits 0. ``--quick`` shrinks the benchmark shapes (used by the GPU test).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

__all__ = ["main"]

# Benchmark shape (a Llama-3-8B layer): Hq 32 / Hkv 8, head_dim 128, block size 16, bf16.
HQ, HKV, D, BS = 32, 8, 128, 16
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Row:
    """One line of the report."""

    name: str
    shape: str
    error: float | None  # vs the reference (None: timing only)
    tolerance: float | None
    ms: float | None
    metric: str  # "GB/s", "TFLOP/s" or ""
    value: float | None
    fraction: float | None  # of the same-run ceiling (copy bandwidth or matmul TFLOP/s)

    @property
    def ok(self) -> bool:
        return self.error is None or self.error <= (self.tolerance or 0.0)


@dataclass(frozen=True)
class Ceilings:
    copy_gbs: float  # device-to-device copy, bytes read + written per second / 1e9
    matmul_tflops: float  # bf16 matmul


def _checked(name: str, shape: str, error: float, tolerance: float) -> Row:
    return Row(name, shape, error, tolerance, None, "", None, None)


def _timed(
    name: str,
    shape: str,
    error: float | None,
    tolerance: float | None,
    ms: float,
    metric: str,
    value: float,
    ceiling: float,
) -> Row:
    return Row(name, shape, error, tolerance, ms, metric, value, value / ceiling)


def _bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn``."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _equal_error(ok: bool) -> float:
    """Error value of an exact check: 0 if equal, inf otherwise."""
    return 0.0 if ok else float("inf")


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs error relative to the largest |expected| (bf16 rounding scales with size)."""
    from pdserve.kernels.testing import max_abs_error

    return max_abs_error(actual, expected) / max(expected.abs().max().item(), 1e-6)


def _measure_ceilings(dev: torch.device, quick: bool) -> tuple[Ceilings, list[Row]]:
    nbytes = (256 if quick else 1024) << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = _bench(lambda: dst.copy_(src))
    copy_gbs = 2 * nbytes / copy_ms / 1e6
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    mm_ms = _bench(lambda: a @ b)
    mm_tflops = 2 * n**3 / mm_ms / 1e9
    rows = [
        Row("d2d copy (ceiling)", f"{nbytes >> 20} MiB", None, None, copy_ms, "GB/s", copy_gbs, 1),
        Row("bf16 matmul (ceiling)", f"{n}^3", None, None, mm_ms, "TFLOP/s", mm_tflops, 1),
    ]
    return Ceilings(copy_gbs, mm_tflops), rows


def _check_attention(dev: torch.device) -> list[Row]:
    """Both attention kernels vs the reference over mixed batches, ratios, dtypes, splits."""
    from pdserve.kernels import ops
    from pdserve.kernels import reference as R
    from pdserve.kernels.testing import ATTN_TOL, make_batch, max_abs_error, random_lengths
    from pdserve.kernels.triton.decode import paged_decode_attention_triton

    rows: list[Row] = []
    cases = [
        (1, 64, 16, torch.float32),
        (4, 128, 32, torch.bfloat16),
        (8, 128, 16, torch.bfloat16),
        (4, 64, 16, torch.float16),
        (8, 64, 32, torch.float32),
        (16, 576, 16, torch.bfloat16),  # DeepSeek-V3's MLA: one CUDA call's 16 heads, latent
    ]
    for seed, (ratio, d, bs, dtype) in enumerate(cases):
        hkv = 2 if ratio < 8 else 1
        heads = {"num_q_heads": hkv * ratio, "num_kv_heads": hkv, "head_dim": d}
        q_lens, ctx_lens = random_lengths(seed, 12, max_ctx=3000, max_new=600)
        label = f"S=12 g={ratio} D={d} B={bs} {str(dtype).removeprefix('torch.')}"
        mixed = make_batch(
            seed, q_lens, ctx_lens, **heads, block_size=bs, dtype=dtype, device=dev
        ).attention_args()
        err = max_abs_error(ops.paged_attention(*mixed), R.paged_attention_ref(*mixed))
        rows.append(_checked("paged_attention", f"mixed {label}", err, ATTN_TOL[dtype]))
        dec = make_batch(
            seed, [1] * 12, ctx_lens, **heads, block_size=bs, dtype=dtype, device=dev
        ).decode_args()
        expected = R.paged_decode_attention_ref(*dec)
        for splits in (None, 1, 5):
            err = max_abs_error(paged_decode_attention_triton(*dec, num_splits=splits), expected)
            shape = f"{label} splits={splits or 'auto'}"
            rows.append(_checked("paged_decode_attention", shape, err, ATTN_TOL[dtype]))
    # The variants some models need: a window (Gemma, gpt-oss), logit softcap (Gemma 2),
    # sinks (gpt-oss), on mixed and decode batches.
    heads = {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64}
    q_lens, ctx_lens = random_lengths(7, 12, max_ctx=3000, max_new=600)
    sinks = torch.linspace(-1.0, 2.0, 8, device=dev)
    variants: dict[str, tuple[int | None, float | None, torch.Tensor | None]] = {
        "window=128": (128, None, None),
        "softcap=30": (None, 30.0, None),
        "sinks": (None, None, sinks),
        "window+sinks": (128, None, sinks),
    }
    for dtype in (torch.float32, torch.bfloat16):
        for name, (window, cap, sink) in variants.items():
            label = f"{name} S=12 g=4 D=64 B=16 {str(dtype).removeprefix('torch.')}"
            for kind, q_len in (("mixed", q_lens), ("decode", [1] * 12)):
                batch = make_batch(
                    7, q_len, ctx_lens, **heads, block_size=16, dtype=dtype, device=dev
                )
                want = R.paged_attention_ref(*batch.attention_args(), window, cap, sink)
                if kind == "decode":
                    op = "paged_decode_attention"
                    got = ops.paged_decode_attention(*batch.decode_args(), window, cap, sink)
                else:
                    op = "paged_attention"
                    got = ops.paged_attention(*batch.attention_args(), window, cap, sink)
                err = max_abs_error(got, want)
                rows.append(_checked(op, f"{kind} {label}", err, ATTN_TOL[dtype]))
    return rows


def _bench_decode(dev: torch.device, quick: bool, ceil: Ceilings) -> Row:
    from pdserve.kernels import ops
    from pdserve.kernels import reference as R
    from pdserve.kernels.testing import ATTN_TOL, make_batch, max_abs_error

    num_seqs, ctx = (16, 1024) if quick else (64, 4096)
    args = make_batch(
        1234,
        [1] * num_seqs,
        [ctx] * num_seqs,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        block_size=BS,
        dtype=torch.bfloat16,
        device=dev,
    ).decode_args()
    err = max_abs_error(ops.paged_decode_attention(*args), R.paged_decode_attention_ref(*args))
    ms = _bench(lambda: ops.paged_decode_attention(*args))
    moved = 2 * num_seqs * ctx * HKV * D * 2 + 2 * args[0].numel() * 2  # K, V read; q, out
    gbs = moved / ms / 1e6
    shape = f"S={num_seqs} ctx={ctx} Hq={HQ} Hkv={HKV} D={D} bf16"
    tol = ATTN_TOL[torch.bfloat16]
    return _timed("paged_decode_attention", shape, err, tol, ms, "GB/s", gbs, ceil.copy_gbs)


def _bench_prefill(dev: torch.device, quick: bool, ceil: Ceilings) -> list[Row]:
    """8k new tokens as one causal prompt, and as 4 chunks after a cached prefix each."""
    from pdserve.kernels import ops
    from pdserve.kernels import reference as R
    from pdserve.kernels.testing import ATTN_TOL, make_batch, max_abs_error

    total = 2048 if quick else 8192
    rows = []
    for label, q_lens, ctx_lens in [
        ("prompt", [total], [total]),
        ("chunked", [total // 4] * 4, [total // 2] * 4),
    ]:
        args = make_batch(
            99,
            q_lens,
            ctx_lens,
            num_q_heads=HQ,
            num_kv_heads=HKV,
            head_dim=D,
            block_size=BS,
            dtype=torch.bfloat16,
            device=dev,
        ).attention_args()
        err = max_abs_error(ops.paged_attention(*args), R.paged_attention_ref(*args))
        ms = _bench(functools.partial(ops.paged_attention, *args))
        # visible (query, key) pairs x 2 matmuls x 2 flop per multiply-add x D x heads
        pairs = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(q_lens, ctx_lens, strict=True))
        tflops = 4 * pairs * D * HQ / ms / 1e9
        shape = f"{label} T={sum(q_lens)} ctx={ctx_lens[0]} Hq={HQ} Hkv={HKV} D={D} bf16"
        tol = ATTN_TOL[torch.bfloat16]
        rows.append(
            _timed("paged_attention", shape, err, tol, ms, "TFLOP/s", tflops, ceil.matmul_tflops)
        )

    # torch's SDPA on the same dense (unpaged) causal prompt, as a reference point.
    q = torch.randn(1, HQ, total, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, HKV, total, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        ms = _bench(lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True))
    except RuntimeError as exc:  # no fused GQA kernel in this torch build
        print(f"pdserve.kernels.triton.gpu_check: skipping the SDPA reference point: {exc}")
        return rows
    tflops = 4 * (total * (total + 1) // 2) * D * HQ / ms / 1e9
    shape = f"dense prompt T={total} Hq={HQ} Hkv={HKV} D={D} bf16"
    rows.append(
        _timed("torch sdpa (context)", shape, None, None, ms, "TFLOP/s", tflops, ceil.matmul_tflops)
    )
    return rows


def _bench_blocks(dev: torch.device, quick: bool, ceil: Ceilings) -> list[Row]:
    """Gather a quarter of the blocks of all layers (and of one layer), scatter them back."""
    from pdserve.kernels import ops
    from pdserve.kernels import reference as R

    copy = ceil.copy_gbs
    gen = torch.Generator(device=dev).manual_seed(0)
    layers, num_blocks = (4, 512) if quick else (32, 2048)
    kv = torch.randn(layers, 2, num_blocks, BS, HKV, D, device=dev, generator=gen)
    kv = kv.to(torch.bfloat16)
    n = num_blocks // 4
    ids = torch.randperm(num_blocks, device=dev, generator=gen)[:n]
    dest_ids = torch.randperm(num_blocks, device=dev, generator=gen)[:n]
    shape = f"L={layers} {n} of {num_blocks} blocks {BS}x{HKV}x{D} bf16"
    rows = []

    packed = ops.gather_blocks(kv, ids)
    err = _equal_error(torch.equal(packed, R.gather_blocks_ref(kv, ids)))
    moved = 2 * packed.numel() * packed.element_size()  # read + write
    ms = _bench(lambda: ops.gather_blocks(kv, ids))
    gbs = moved / ms / 1e6
    rows.append(_timed("gather_blocks (all layers)", shape, err, 0.0, ms, "GB/s", gbs, copy))

    layer = kv[0]
    err = _equal_error(torch.equal(ops.gather_blocks(layer, ids), layer[:, ids]))
    ms = _bench(lambda: ops.gather_blocks(layer, ids))
    gbs = moved / layers / ms / 1e6
    shape_one = f"{n} of {num_blocks} blocks"
    rows.append(_timed("gather_blocks (one layer)", shape_one, err, 0.0, ms, "GB/s", gbs, copy))

    expected = kv.clone()
    R.scatter_blocks_ref(packed, expected, dest_ids)
    ops.scatter_blocks(packed, kv, dest_ids)
    err = _equal_error(torch.equal(kv, expected))
    del expected
    ms = _bench(lambda: ops.scatter_blocks(packed, kv, dest_ids))
    gbs = moved / ms / 1e6
    rows.append(_timed("scatter_blocks (all layers)", shape, err, 0.0, ms, "GB/s", gbs, copy))
    return rows


def _bench_elementwise(dev: torch.device, ceil: Ceilings) -> list[Row]:
    """KV write, RMSNorm with residual and rotary over a prefill's worth (8k) of tokens."""
    from pdserve.kernels import ops
    from pdserve.kernels import reference as R

    copy = ceil.copy_gbs
    gen = torch.Generator(device=dev).manual_seed(1)
    tokens, hidden, num_blocks = 8192, 4096, 4096
    rows = []

    k_cache = torch.zeros(num_blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(tokens, HKV, D, device=dev, generator=gen).to(torch.bfloat16)
    value = torch.randn(tokens, HKV, D, device=dev, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * BS, device=dev, generator=gen)[:tokens]
    slots[::97] = -1  # padding
    ops.write_kv(key, value, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    R.write_kv_ref(key, value, k_ref, v_ref, slots)
    err = _equal_error(torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref))
    ms = _bench(lambda: ops.write_kv(key, value, k_cache, v_cache, slots))
    gbs = 2 * 2 * key.numel() * 2 / ms / 1e6
    shape = f"T={tokens} Hkv={HKV} D={D} bf16"
    rows.append(_timed("write_kv", shape, err, 0.0, ms, "GB/s", gbs, copy))

    x = torch.randn(tokens, hidden, device=dev, generator=gen).to(torch.bfloat16)
    res = torch.randn(tokens, hidden, device=dev, generator=gen)  # the float32 stream
    w = torch.randn(hidden, device=dev, generator=gen).to(torch.bfloat16)
    out, new_res = ops.rms_norm(x, w, 1e-5, res)
    ref_out, ref_res = R.rms_norm_ref(x, w, 1e-5, res)
    err = max(_rel_error(out, ref_out), _rel_error(new_res, ref_res))
    ms = _bench(lambda: ops.rms_norm(x, w, 1e-5, res))
    gbs = x.numel() * (2 + 4 + 2 + 4) / ms / 1e6  # x, residual in; out, new residual out
    shape = f"T={tokens} H={hidden} bf16 +fp32 residual"
    rows.append(_timed("rms_norm (rel. err)", shape, err, 1e-2, ms, "GB/s", gbs, copy))

    gate_up = (torch.randn(tokens, 2 * 4 * hidden, device=dev, generator=gen) * 4).to(
        torch.bfloat16
    )
    err = _rel_error(ops.silu_and_mul(gate_up), R.silu_and_mul_ref(gate_up))
    ms = _bench(lambda: ops.silu_and_mul(gate_up))
    gbs = gate_up.numel() * 3 // 2 * 2 / ms / 1e6
    shape = f"T={tokens} I={4 * hidden} bf16"
    rows.append(_timed("silu_and_mul (rel. err)", shape, err, 1e-2, ms, "GB/s", gbs, copy))

    cache = ops.build_rope_cache(D, 8192, 500000.0, LLAMA3_SCALING, torch.float32, dev)
    positions = torch.randint(0, 8192, (tokens,), device=dev, generator=gen)
    q = torch.randn(tokens, HQ, D, device=dev, generator=gen).to(torch.bfloat16)
    k = torch.randn(tokens, HKV, D, device=dev, generator=gen).to(torch.bfloat16)
    got_q, got_k = ops.apply_rotary(positions, q, k, cache)
    ref_q, ref_k = R.apply_rotary_ref(positions, q, k, cache)
    err = max(_rel_error(got_q, ref_q), _rel_error(got_k, ref_k))
    ms = _bench(lambda: ops.apply_rotary(positions, q, k, cache))
    gbs = 2 * (q.numel() + k.numel()) * 2 / ms / 1e6
    shape = f"T={tokens} Hq={HQ} Hkv={HKV} D={D} bf16 llama3"
    rows.append(_timed("apply_rotary (rel. err)", shape, err, 1e-2, ms, "GB/s", gbs, copy))
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_table(rows: list[Row]) -> None:
    header = f"{'kernel':<28} {'shape':<50} {'err/tol':>18} {'ms':>9} {'speed':>17} {'frac':>5}"
    print(header)
    print("-" * len(header))
    for r in rows:
        check = "-" if r.error is None else f"{r.error:.1e}/{r.tolerance:.0e}"
        if not r.ok:
            check += " FAIL"
        speed = "-" if r.value is None else f"{r.value:.1f} {r.metric}"
        print(
            f"{r.name:<28} {r.shape:<50} {check:>18} {_fmt(r.ms, '.3f'):>9} {speed:>17} "
            f"{_fmt(r.fraction, '.2f'):>5}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check and time the Triton kernels on CUDA.")
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON report")
    parser.add_argument("--quick", action="store_true", help="smaller benchmark shapes")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "pdserve.kernels.triton.gpu_check: CUDA is not available; nothing to check here "
            "(tests/kernels cover the CPU paths and the kernels in Triton's interpreter)."
        )
        return 0
    if os.environ.pop("TRITON_INTERPRET", None):  # must go before the kernels are imported
        print(
            "pdserve.kernels.triton.gpu_check: ignoring TRITON_INTERPRET to run the compiled "
            "kernels"
        )
    try:
        import triton
    except ImportError as exc:
        print(f"pdserve.kernels.triton.gpu_check: triton is not importable ({exc})")
        return 1
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ceil, rows = _measure_ceilings(dev, args.quick)
    rows += _check_attention(dev)
    from pdserve.kernels.triton.gpu_check_kvquant import check_quantized_kv

    rows += check_quantized_kv(dev)
    from pdserve.kernels.triton.gpu_check_mla import check_mla

    rows += check_mla(dev, args.quick, ceil)
    torch.cuda.empty_cache()
    rows.append(_bench_decode(dev, args.quick, ceil))
    torch.cuda.empty_cache()
    rows += _bench_prefill(dev, args.quick, ceil)
    torch.cuda.empty_cache()
    rows += _bench_blocks(dev, args.quick, ceil)
    torch.cuda.empty_cache()
    rows += _bench_elementwise(dev, ceil)
    torch.cuda.empty_cache()
    from pdserve.kernels.triton.gpu_check_moe import bench_moe

    rows += bench_moe(dev, args.quick, ceil)
    _print_table(rows)
    report = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "quick": args.quick,
        "ceilings": asdict(ceil),
        "rows": [asdict(r) | {"ok": r.ok} for r in rows],
        "all_ok": all(r.ok for r in rows),
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}; all checks {'passed' if report['all_ok'] else 'FAILED'}")
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
