"""Per-linear speed of the CPU int8 kernels against the bf16 matmul, at decode sizes.

    python -P -m pdserve.bench.quant_linear [--rows 1 8 16 32] [--threads 1 2] [--rounds 7]
                                            [--out FILE.json]

The four linears of one decoder layer of the ``small`` test model (qkv 1280x768, o 768x768,
gate_up 5120x768, down 768x2560; random weights, per-channel int8 by
``kernels/quant_reference.quantize_weight``), bf16 activations. Candidates, each timed on
identical inputs, alternating within a round:

- ``bf16 oneDNN``: the bf16 weight in oneDNN's packed layout (``kernels/cpu/linear.py``'s
  ``PackedLinear``, what a bf16 model runs on an AMX CPU);
- ``w8a8 _int_mm``: per-token quantization in torch, then ``torch._int_mm`` (oneDNN);
- ``w8a16 _weight_int8pack_mm``: torch's int8-weight GEMV;
- ``w8a16 tiled dequant``: a tile of weight rows dequantized to bf16, then ``F.linear``;
- ``w8a8 native`` / ``w8a16 native 2 planes``: ``kernels/cpu/csrc/linear_int8.cpp`` (VNNI)
  with one / two int8 planes per activation row; ``w8a16 2 planes _int_mm``: the two planes
  through ``torch._int_mm``; ``w8a8 oneDNN int8``: the native quantizer, oneDNN's
  prepacked int8 matmul, the native epilogue (what more than 16 rows ran before AMX);
- ``w8a8 AMX`` / ``w8a16 AMX 2 planes``: ``kernels/cpu/csrc/linear_int8_amx.cpp``;
- ``Int8Linear`` / ``Int8WeightOnlyLinear``: the modules the engine runs, which pick
  among these by row count (``kernels/cpu/quant_linear.py``).

Prints, per thread count and row count, the microseconds of the whole layer (the four
linears; min and median over rounds of wall time, the min being the least disturbed by
other jobs on a shared machine), the weight bytes read per microsecond (GB/s at the min),
the min of this process's CPU time (with one thread: the kernel's own time, whatever else
runs on the machine), and the max error against ``quant_reference`` relative to the
output's largest value.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import quant_reference as ref
from pdserve.kernels.cpu import int8_native
from pdserve.kernels.cpu.linear import PackedLinear, can_pack
from pdserve.kernels.cpu.quant_linear import (
    Int8Linear,
    Int8WeightOnlyLinear,
    onednn_int8_sums,
    onednn_int8_supported,
)

SHAPES = {"qkv": (1280, 768), "o": (768, 768), "gate_up": (5120, 768), "down": (768, 2560)}
Fn = Callable[[torch.Tensor], torch.Tensor]


def _candidates(q: torch.Tensor, scale: torch.Tensor, w: torch.Tensor) -> dict[str, Fn]:
    out: dict[str, Fn] = {}
    if can_pack(torch.bfloat16, torch.device("cpu")):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        lin.weight.data.copy_(w)
        out["bf16 oneDNN"] = PackedLinear(lin)
    else:
        wb = w.to(torch.bfloat16)
        out["bf16 F.linear"] = lambda x: F.linear(x, wb)
    qt, srow = q.t(), scale.reshape(1, -1)

    def int_mm(x: torch.Tensor) -> torch.Tensor:
        xq, xs = ref.quantize_per_token_int8(x)
        return (torch._int_mm(xq, qt).float() * xs * srow).to(x.dtype)

    out["w8a8 _int_mm"] = int_mm
    sb = scale.reshape(-1).to(torch.bfloat16)
    out["w8a16 _weight_int8pack_mm"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, q, sb)
    tile = max(16, (1 << 20) // (2 * q.shape[1]))

    def tiled(x: torch.Tensor) -> torch.Tensor:
        parts = [
            F.linear(x, ref.dequantize_weight(q[i : i + tile], scale[i : i + tile], x.dtype))
            for i in range(0, q.shape[0], tile)
        ]
        return torch.cat(parts, -1)

    out["w8a16 tiled dequant"] = tiled
    if int8_native.available():
        packed = int8_native.PackedInt8.pack(q, scale)
        out["w8a8 native"] = lambda x: int8_native.linear(x, packed, None, 1)
        out["w8a16 native 2 planes"] = lambda x: int8_native.linear(x, packed, None, 2)

        def planes_int_mm(x: torch.Tensor) -> torch.Tensor:
            xq, xs = int8_native.quantize(x, 2)
            out = torch._int_mm(xq, qt).float() * xs * srow
            return out.view(x.shape[0], 2, -1).sum(1).to(x.dtype)

        out["w8a16 2 planes _int_mm"] = planes_int_mm
        if onednn_int8_supported():
            prepacked = torch.ops.onednn.qlinear_prepack(q, None)

            def onednn(x: torch.Tensor) -> torch.Tensor:
                xq, xs = int8_native.quantize(x, 1)
                acc = onednn_int8_sums(xq, prepacked, q.shape[0])
                return int8_native.finish(acc, xs, packed.scale, None, 1, x.dtype)

            out["w8a8 oneDNN int8"] = onednn
    if int8_native.amx_available():
        out["w8a8 AMX"] = lambda x: int8_native.linear(x, packed, None, 1, amx=True)
        out["w8a16 AMX 2 planes"] = lambda x: int8_native.linear(x, packed, None, 2, amx=True)
    out["Int8Linear"] = Int8Linear(q, scale, None)
    out["Int8WeightOnlyLinear"] = Int8WeightOnlyLinear(q, scale, None, torch.bfloat16)
    return out


def _error(name: str, fn: Fn, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> float:
    if name.startswith("bf16"):
        return float("nan")
    w8a8 = "w8a8" in name or name == "Int8Linear"
    want = ref.w8a8_linear(x, q, scale) if w8a8 else ref.weight_only_linear(x, q, scale)
    return float((fn(x).float() - want).abs().max() / want.abs().max())


def run(rows: list[int], threads: list[int], rounds: int) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(0)
    layers = []
    for n, k in SHAPES.values():
        w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).float()
        q, scale = ref.quantize_weight(w, torch.int8)
        layers.append((q, scale, _candidates(q, scale, w)))
    names = list(layers[0][2])
    weights = sum(n * k for n, k in SHAPES.values())
    results: list[dict[str, object]] = []
    for t in threads:
        torch.set_num_threads(t)
        for m in rows:
            xs = [torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in SHAPES.values()]
            times: dict[str, list[float]] = {nm: [] for nm in names}
            cpu: dict[str, list[float]] = {nm: [] for nm in names}
            for _ in range(rounds):
                for nm in names:
                    for (_, _, c), x in zip(layers, xs, strict=True):
                        c[nm](x)  # warm
                    start, start_cpu = time.perf_counter(), time.process_time()
                    for _ in range(5):
                        for (_, _, c), x in zip(layers, xs, strict=True):
                            c[nm](x)
                    times[nm].append((time.perf_counter() - start) / 5 * 1e6)
                    cpu[nm].append((time.process_time() - start_cpu) / 5 * 1e6)
            for nm in names:
                bytes_per = weights * (2 if nm.startswith("bf16") else 1)
                err = max(
                    _error(nm, c[nm], x, q, s) for (q, s, c), x in zip(layers, xs, strict=True)
                )
                best = min(times[nm])
                results.append(
                    {"threads": t, "rows": m, "kernel": nm, "us_min": best,
                     "us_median": statistics.median(times[nm]), "cpu_us_min": min(cpu[nm]),
                     "gb_per_s": bytes_per / best / 1e3, "max_rel_err": err}
                )  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()}")
    results = run(args.rows, args.threads, args.rounds)
    head = ("thr", "rows", "kernel", "us min", "us med", "GB/s", "cpu min", "err")
    print("{:>3} {:>4} {:<28} {:>8} {:>8} {:>6} {:>8} {:>8}".format(*head))
    for r in results:
        print(
            f"{r['threads']:>3} {r['rows']:>4} {r['kernel']:<28} {r['us_min']:>8.0f} "
            f"{r['us_median']:>8.0f} {r['gb_per_s']:>6.1f} {r['cpu_us_min']:>8.0f} "
            f"{r['max_rel_err']:>8.1e}"
        )
    print(f"load average {os.getloadavg()}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
