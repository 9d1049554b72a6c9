"""Prove the GPU path in one device run: ``python -m pdserve.bench.gpu_verify --out DIR``.

Runs on the device image as it is (torch + CUDA, Triton, CuPy, transformers; no Ray, and
pydantic carried as a wheel if missing), from a checkout without installing pdserve:
``bench/gpu_verify.sh --out DIR`` builds a ``pdserve/`` symlink farm and runs this module.
Steps (``gpu_verify_steps``), each a list of report rows:

1. kernels: every Triton kernel vs its torch reference (fp32/bf16/fp16, GQA 1/4/8, head
   dims 64/128, block sizes 16/32) and its speed as a fraction of the H200's; the int8 /
   fp8 GEMMs vs their references and their speed against the bf16 matmul;
2. engine: greedy tokens equal transformers (fp32) on the three test configs with mixed
   lengths, chunked prefill and preemption; bf16 logits within a stated tolerance; the
   native Gemma 2 / 3 classes on tiny models built there (``gpu_verify_gemma``); the
   same tokens check for a small DeepSeek-V3 on the native MLA class (``gpu_verify_mla``);
3. disagg: prefill and decode engines in two processes, KV over CUDA IPC on one GPU,
   tokens equal the single engine; byte checks of CUDA IPC, and NCCL with two GPUs;
4. throughput: decode tokens/s at batch 1/8/32/128, CUDA graphs on and off, vs
   transformers ``generate``, and
   Triton compilations after warm-up (must be 0);
5. tp: tensor parallelism over two GPUs (NCCL): greedy tokens equal transformers with
   chunked prefill and preemption (skipped, with the reason, on one GPU);
6. numerics: ``bench.numerics`` on the device (the Triton path in bf16 and transformers
   bf16, each against transformers fp32, stage by stage); the engine at least as close;
7. tfgraphs: the transformers model path with decode CUDA graphs (greedy tokens equal
   transformers', graphs replayed for a dense Llama; a Qwen3-MoE reported captured or
   eager) and its decode tok/s with graphs on and off.

Writes ``DIR/gpu_verify.json`` and ``DIR/gpu_verify.txt`` (the table), exits 1 if any
check failed or any step raised. ``--dry-run`` plans the steps and imports everything they
import (the CI test runs it with Ray blocked), and runs nothing on a device.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

STEPS = ("kernels", "engine", "disagg", "throughput", "tp", "numerics", "tfgraphs")
BUDGET_S = 8 * 60
# What the steps import on the device (the dry run imports each; none may need Ray).
DEVICE_MODULES = (
    "torch",
    "triton",
    "transformers",
    "pdserve.bench.gpu_verify_steps",
    "pdserve.bench.gpu_verify_gemma",
    "pdserve.bench.gpu_verify_mla",
    "pdserve.bench.numerics",
    "pdserve.bench.moe",
    "pdserve.kernels.ops",
    "pdserve.kernels.reference",
    "pdserve.kernels.testing",
    "pdserve.kernels.triton.decode",
    "pdserve.kernels.triton.prefill",
    "pdserve.kernels.triton.kv",
    "pdserve.kernels.triton.norm",
    "pdserve.kernels.triton.activation",
    "pdserve.kernels.triton.rotary",
    "pdserve.kernels.triton.quant_gemm",
    "pdserve.kernels.triton.gpu_check",
    "pdserve.kernels.triton.gpu_check_kvquant",
    "pdserve.kernels.kv_quant",
    "pdserve.kernels.triton.jit_count",
    "pdserve.engine.llm_engine",
    "pdserve.engine.parallel",
    "pdserve.engine.tp_executor",
    "pdserve.engine.tp_worker",
    "pdserve.engine.model_runner",
    "pdserve.engine.testmodel",
    "pdserve.engine.scheduler_output",
    "pdserve.kvtransfer.blocks",
    "pdserve.kvtransfer.connector",
    "pdserve.kvtransfer.receiver",
    "pdserve.kvtransfer.sender",
    "pdserve.kvtransfer.cuda_ipc",
    "pdserve.kvtransfer.gpu_check",
    "pdserve.kvtransfer.gpu_ids",
)
# Needed on the device but not installed there: carried as wheels (device README).
CARRIED = ("pydantic",)


def dry_run() -> tuple[bool, dict]:
    """Import every module the steps need; Ray must stay out of the process."""
    imported, failed = [], {}
    for name in DEVICE_MODULES:
        try:
            importlib.import_module(name)
            imported.append(name)
        except Exception as exc:  # noqa: BLE001 - reported, and fails the dry run
            failed[name] = f"{type(exc).__name__}: {exc}"
    ray_loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
    carried = {n: n in sys.modules for n in CARRIED}
    import pdserve.bench

    plan = {
        "steps": list(STEPS),
        "imported": imported,
        "failed": failed,
        "ray_modules_loaded": ray_loaded,
        "carried_and_used": carried,
        "pdserve_from": str(Path(pdserve.bench.__file__).parent.parent),
    }
    return not failed and not ray_loaded, plan


def _run_step(name: str, model_root: Path, quick: bool) -> list:
    from pdserve.bench import gpu_verify_steps as s

    if name == "kernels":
        return s.kernels(quick)
    if name == "engine":
        from pdserve.bench.gpu_verify_gemma import gemma_vs_transformers
        from pdserve.bench.gpu_verify_mla import mla_vs_transformers

        return (
            s.engine_vs_transformers(model_root)
            + gemma_vs_transformers(model_root)
            + mla_vs_transformers(model_root)
        )
    if name == "disagg":
        return s.disaggregated(model_root)
    if name == "tp":
        return s.tensor_parallel(model_root)
    if name == "numerics":
        return s.numerics(model_root, quick)
    if name == "tfgraphs":
        return s.transformers_graphs(model_root)
    return s.throughput(model_root, quick)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'step':<11}{'result':<7}{'value':>12}  {'check':<58}note"]
    for r in rows:
        result = {True: "ok", False: "FAIL", None: "skip"}[r["ok"]]
        value = "" if r["value"] is None else f"{r['value']:.4g}"
        lines.append(f"{r['step']:<11}{result:<7}{value:>12}  {r['check']:<58}{r['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Verify pdserve's GPU path on one GPU.")
    parser.add_argument("--out", required=True, help="directory for the JSON and the table")
    parser.add_argument("--dry-run", action="store_true", help="plan and import only")
    parser.add_argument("--quick", action="store_true", help="smaller benchmark shapes")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        ok, plan = dry_run()
        plan["would_run"] = args.steps
        (out / "gpu_verify_plan.json").write_text(json.dumps(plan, indent=2))
        print(json.dumps(plan, indent=2))
        print(f"dry run {'ok' if ok else 'FAILED'}")
        return 0 if ok else 1

    # The compiled kernels, not Triton's interpreter (must go before triton is imported).
    os.environ.pop("TRITON_INTERPRET", None)
    import torch

    if not torch.cuda.is_available():
        print("gpu_verify: CUDA is not available; use --dry-run on a machine without a GPU")
        return 1
    started = time.perf_counter()
    model_root = Path(tempfile.mkdtemp(prefix="pdserve-models-"))
    rows: list[dict] = []
    timings: dict[str, float] = {}
    for step in args.steps:
        t0 = time.perf_counter()
        print(f"== {step}", flush=True)
        try:
            rows += [asdict(r) for r in _run_step(step, model_root, args.quick)]
        except Exception as exc:  # noqa: BLE001 - a broken step is a failure, the rest run
            traceback.print_exc()
            rows.append(
                {
                    "step": step,
                    "check": "step raised",
                    "ok": False,
                    "value": None,
                    "unit": "",
                    "limit": None,
                    "note": f"{type(exc).__name__}: {exc}"[:300],
                }  # fmt: skip
            )
        timings[step] = time.perf_counter() - t0
        print(format_table([r for r in rows if r["step"] == step]), flush=True)
    total = time.perf_counter() - started
    failed = [r for r in rows if r["ok"] is False]
    if total > BUDGET_S:
        failed.append({"check": f"finished in {total:.0f} s > {BUDGET_S} s"})
    report = {
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seconds": timings,
        "total_s": total,
        "rows": rows,
        "all_ok": not failed,
    }
    (out / "gpu_verify.json").write_text(json.dumps(report, indent=2))
    table = format_table(rows)
    (out / "gpu_verify.txt").write_text(table + "\n")
    print(f"\n{table}\n\n{len(rows)} rows, {len(failed)} failed, {total:.0f} s")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
