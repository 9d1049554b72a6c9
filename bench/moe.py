"""The fused MoE against a per-expert loop on a tiny-but-wide MoE layer, on this machine.

    python -P -m pdserve.bench.moe [--experts 64] [--top-k 8] [--hidden 512] [--inter 256]
                                   [--batch 1 8 32] [--dtype float32 bfloat16] [--rounds 5]
                                   [--threads 1] [--out FILE.json]
    python -P -m pdserve.bench.moe --write-model DIR [--arch qwen3-moe|gpt-oss]
                                   # a checkpoint with that expert shape

For each dtype and batch (tokens in the step), times on identical inputs:
  - ``fused packed`` (CPU only): ``kernels.ops.fused_moe`` on the experts prepacked for
    oneDNN (``PackedExperts``, what a loaded bf16 model runs on a CPU with native bf16;
    packed here in float32 too, for comparison);
  - ``fused unpacked``: ``kernels.ops.fused_moe`` on the stacked weights (tokens sorted by
    expert, each expert's GEMMs once over its tokens; the Triton kernel on CUDA);
  - ``fused int8 w8a8`` / ``fused int8 w-only`` (CPU only): the experts quantized to int8 per
    channel (``QuantizedExperts``, what at-load ``quantization: int8`` /
    ``int8-weight-only`` runs on a CPU), each segment on the int8 linear kernels; their
    error includes the int8 rounding;
  - ``per-expert loop``: transformers' own eager experts forward (a mask and a gather per
    expert, as Mixtral / Qwen3-MoE modelling code runs it);
  - ``transformers grouped_mm``: transformers' default experts implementation where torch
    has ``_grouped_mm``, for context.
Each row is the median over rounds (the implementations alternate within a round) of CPU
time of this process (``time.process_time``; wall time after a synchronize on CUDA), and
the max error of each against ``kernels/moe_reference.py`` relative to the output's
largest value. Then the Triton kernel is run under Triton's interpreter (a subprocess with
``TRITON_INTERPRET=1``, CPU only) at batch 8 of a narrower layer in float32 and its error
printed (triton 3.5.1's interpreter multiplies bf16 bit patterns in ``tl.dot``; the kernel
tests patch that, see tests/kernels/conftest.py, and check bf16 there).
Prints a table and writes JSON.

``--write-model`` writes a random Qwen3-MoE (or, with ``--arch gpt-oss``, gpt-oss: biased
attention with sinks, window-128 and full layers alternating, YaRN, biased experts with the
clamped SwiGLU) checkpoint of the same expert shape (built by transformers, the tiny test
tokenizer) for ``bench.model_impl --model DIR`` (native class vs transformers path on the
same checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve.kernels import ops
from pdserve.kernels.moe_reference import fused_moe_ref

_INTERPRET_SHAPE = {"tokens": 8, "hidden": 128, "inter": 64}


def _problem(
    tokens: int, args: argparse.Namespace, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    e, h, i = args.experts, args.hidden, args.inter
    x = torch.randn(tokens, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    logits = torch.randn(tokens, e, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), args.top_k, dim=-1)
    return tuple(
        t.to(device, dtype) if t.is_floating_point() and t is not weights else t.to(device)
        for t in (x, w13, w2, weights, ids)
    )


def _transformers_experts(
    args: argparse.Namespace, w13: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.nn.Module, Any]:
    """transformers' Qwen3-MoE experts module holding the same weights (its layout is ours)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.inter,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    experts = Qwen3MoeExperts(config).to(device=w13.device, dtype=w13.dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
    return experts, config


def _clock_ms(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    clock = time.perf_counter if cuda else time.process_time
    if cuda:
        torch.cuda.synchronize()
    start = clock()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (clock() - start) / iters * 1000


def _rel_error(out: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.float().abs().max().item(), 1e-6)
    return (out.float() - want.float()).abs().max().item() / scale


def _bench_case(
    tokens: int, dtype: torch.dtype, args: argparse.Namespace, device: torch.device
) -> dict[str, object]:
    x, w13, w2, weights, ids = _problem(tokens, args, dtype, device, seed=tokens)
    experts, config = _transformers_experts(args, w13, w2)

    def hf(impl: str) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            config._experts_implementation = impl
            return experts(x, ids, weights.to(dtype))

        return call

    impls: dict[str, Callable[[], torch.Tensor]] = {}
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        packed = ops.PackedExperts.pack(w13, w2)
        impls["fused packed"] = lambda: ops.fused_moe(x, w13, w2, weights, ids, packed=packed)
    impls["fused unpacked"] = lambda: ops.fused_moe(x, w13, w2, weights, ids)
    if device.type == "cpu":
        w8a8 = ops.quantize_experts(w13, w2, "w8a8")
        w8 = ops.quantize_experts(w13, w2, "weight-only")
        impls["fused int8 w8a8"] = lambda: ops.fused_moe(x, w13, w2, weights, ids, packed=w8a8)
        impls["fused int8 w-only"] = lambda: ops.fused_moe(x, w13, w2, weights, ids, packed=w8)
    impls["per-expert loop"] = hf("eager")
    if hasattr(torch, "_grouped_mm"):
        impls["transformers grouped_mm"] = hf("grouped_mm")
    want = fused_moe_ref(x, w13, w2, weights, ids)
    cuda = device.type == "cuda"
    times: dict[str, list[float]] = {name: [] for name in impls}
    errors = {}
    with torch.no_grad():
        for name, fn in impls.items():
            errors[name] = _rel_error(fn(), want)  # also the warm-up
        for _ in range(args.rounds):
            for name, fn in impls.items():
                times[name].append(_clock_ms(fn, args.iters, cuda))
    ms = {name: statistics.median(t) for name, t in times.items()}
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "batch": tokens,
        "experts_hit": int(ids.unique().numel()),
        "ms": ms,
        "rel_error": errors,
        "speedup_vs_loop": {
            name: ms["per-expert loop"] / ms[name] for name in ms if name.startswith("fused")
        },
    }


def _interpreter_check(args: argparse.Namespace) -> dict[str, object]:
    """The Triton kernel under the interpreter, in a subprocess (the variable must be set
    before triton is imported)."""
    code = (
        "import json, sys; from pdserve.bench.moe import interpreted_error; "
        "print(json.dumps(interpreted_error(*map(int, sys.argv[1:]))))"
    )
    shape = _INTERPRET_SHAPE
    cmd = [sys.executable, "-P", "-c", code]
    cmd += [str(v) for v in (shape["tokens"], args.experts, args.top_k, shape["hidden"])]
    cmd.append(str(shape["inter"]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": time.perf_counter() - start}


def interpreted_error(tokens: int, experts: int, top_k: int, hidden: int, inter: int) -> dict:
    """Max error of the (interpreted) Triton kernel vs the reference, float32."""
    from pdserve.kernels.triton.moe import fused_moe_triton

    args = argparse.Namespace(experts=experts, top_k=top_k, hidden=hidden, inter=inter)
    out: dict[str, object] = {"tokens": tokens, "hidden": hidden, "inter": inter}
    x, w13, w2, weights, ids = _problem(tokens, args, torch.float32, torch.device("cpu"), seed=1)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    out["float32"] = _rel_error(got, fused_moe_ref(x, w13, w2, weights, ids))
    return out


def write_model(out_dir: Path, args: argparse.Namespace) -> Path:
    """A random checkpoint (4 layers) with this benchmark's expert shape."""
    import transformers

    from pdserve.engine.testmodel import ensure_test_model

    common: dict[str, Any] = {
        "vocab_size": 2048,
        "hidden_size": args.hidden,
        "num_experts_per_tok": args.top_k,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if args.arch == "gpt-oss":  # its own defaults otherwise: window 128, YaRN, clamped SwiGLU
        config: Any = transformers.GptOssConfig(
            **common, intermediate_size=args.inter, num_local_experts=args.experts, head_dim=64
        )
    else:
        config = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=4 * args.hidden,
            moe_intermediate_size=args.inter,
            num_experts=args.experts,
            norm_topk_prob=True,
        )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in ensure_test_model("tiny").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fused MoE vs a per-expert loop")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inter", type=int, default=256, help="intermediate size of an expert")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5, help="calls timed per round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--skip-interpreter", action="store_true")
    parser.add_argument("--write-model", type=Path, help="write a checkpoint and exit")
    parser.add_argument(
        "--arch", default="qwen3-moe", choices=["qwen3-moe", "gpt-oss"], help="of --write-model"
    )
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/...)")
    args = parser.parse_args(argv)
    if args.write_model:
        print(f"wrote {write_model(args.write_model, args)}")
        return
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    rows = [_bench_case(b, dtypes[d], args, device) for d in args.dtype for b in args.batch]
    names = list(rows[0]["ms"])  # type: ignore[call-overload]
    clock = "wall" if device.type == "cuda" else "cpu"
    print(
        f"MoE layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert "
        f"intermediate {args.inter}; {device}, {args.threads} thread(s), {clock} time, median "
        f"of {args.rounds} rounds"
    )
    print(f"{'dtype':9s} {'batch':>5s} {'hit':>4s} " + " ".join(f"{n:>24s}" for n in names))
    for r in rows:
        ms, err = r["ms"], r["rel_error"]
        cells = " ".join(f"{ms[n]:9.2f} ms (err {err[n]:.0e})" for n in names)  # type: ignore[index]
        print(f"{r['dtype']:9s} {r['batch']:5d} {r['experts_hit']:4d} {cells}")
    interp = None if args.skip_interpreter or device.type == "cuda" else _interpreter_check(args)
    if interp is not None:
        print(f"Triton kernel under the interpreter vs the reference (rel. error): {interp}")
    out = args.out or Path("bench/results") / f"moe-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    out.write_text(json.dumps({**report, "interpreter": interp}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
