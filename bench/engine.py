"""Engine vs ``transformers.generate``: same model, same prompts, concurrency 1, 8, 32.

    python -m bench.engine [--model DIR | --size small] [--concurrency 1 8 32]
                           [--prompt-len 128] [--max-tokens 32] [--threads N] [--out FILE.json]

For each concurrency c, c prompts of the same length run to ``--max-tokens`` greedy tokens
(eos ignored) once through pdserve's LLMEngine (continuous batching, paged KV) and once
through ``transformers.generate`` (static batching: one padded-free batch of c prompts).
Prints a table and writes JSON with, per system and concurrency: output tokens/s, prefill
latency (time to first token), per-token decode latency, and whether the greedy tokens of
the two systems agree. Defaults take a few minutes on 2 CPU cores with the small model.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.testmodel import SIZES, ensure_test_model


@dataclass(frozen=True)
class Result:
    system: str  # "pdserve" | "transformers"
    concurrency: int
    output_tokens_per_s: float
    prefill_latency_s: float  # mean time to first token
    decode_latency_s_per_token: float  # mean time between output tokens after the first
    wall_s: float


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids below 4 are the test tokenizers' special tokens; harmless for other models too.
    return torch.randint(4, vocab, (n, length), generator=g).tolist()


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[Result, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [f"bench-{start}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    max_steps = 10 * (len(prompts) + 1) * (max_tokens + sum(map(len, prompts)))
    for _ in range(max_steps):
        if len(done) == len(ids):
            break
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
                tokens[out.request_id] = out.token_ids
    else:
        raise RuntimeError("engine did not finish the benchmark requests")
    wall = max(done.values()) - start
    decode = [(done[r] - first[r]) / max(max_tokens - 1, 1) for r in ids]
    result = Result(
        system="pdserve",
        concurrency=len(prompts),
        output_tokens_per_s=len(prompts) * max_tokens / wall,
        prefill_latency_s=statistics.mean(first[r] - start for r in ids),
        decode_latency_s_per_token=statistics.mean(decode),
        wall_s=wall,
    )
    return result, [tokens[r] for r in ids]


def run_transformers(
    model: torch.nn.Module, prompts: list[list[int]], max_tokens: int
) -> tuple[Result, list[list[int]]]:
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Records when each step's logits are ready (the first one right after prefill)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompts, device=model.device)
    clock = StepClock()
    gc = GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=gc,
            logits_processor=LogitsProcessorList([clock]),
        )
    wall = time.perf_counter() - start
    first = clock.times[0] - start
    result = Result(
        system="transformers",
        concurrency=len(prompts),
        output_tokens_per_s=len(prompts) * max_tokens / wall,
        prefill_latency_s=first,
        decode_latency_s_per_token=(wall - first) / max(max_tokens - 1, 1),
        wall_s=wall,
    )
    return result, out[:, ids.shape[1] :].tolist()


def print_table(results: list[Result], agree: dict[int, float]) -> None:
    header = (
        f"{'system':<13}{'conc':>5}{'out tok/s':>11}{'prefill ms':>12}"
        f"{'decode ms/tok':>15}{'same tokens':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.system:<13}{r.concurrency:>5}{r.output_tokens_per_s:>11.1f}"
            f"{r.prefill_latency_s * 1e3:>12.1f}{r.decode_latency_s_per_token * 1e3:>15.2f}"
            f"{agree.get(r.concurrency, float('nan')):>12.0%}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pdserve engine vs transformers.generate")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="local Hugging Face model directory")
    src.add_argument("--size", choices=sorted(SIZES), help="generated test model (default small)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads (default: torch's own choice)"
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/...)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = args.model or ensure_test_model(args.size or "small")
    max_conc = max(args.concurrency)
    seq_len = args.prompt_len + args.max_tokens
    blocks = max_conc * math.ceil(seq_len / args.block_size) + 8
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            num_kv_blocks=blocks,
            max_num_seqs=max(max_conc, 1),
            max_model_len=seq_len,
            enable_prefix_caching=False,  # distinct random prompts: nothing to reuse anyway
        )
    )
    dtype = engine.model_config.dtype
    device = engine.runner.device
    vocab = engine.model_config.vocab_size
    hf = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    # Warm-up (first-call allocations, lazy imports) outside the measurements.
    warm = make_prompts(2, min(args.prompt_len, 16), vocab, seed=99)
    run_engine(engine, warm, 2)
    if hf is not None:
        run_transformers(hf, warm, 2)

    results: list[Result] = []
    agree: dict[int, float] = {}
    for conc in args.concurrency:
        prompts = make_prompts(conc, args.prompt_len, vocab, seed=conc)
        print(f"concurrency {conc}: pdserve ...", file=sys.stderr, flush=True)
        res, ours = run_engine(engine, prompts, args.max_tokens)
        results.append(res)
        if hf is not None:
            print(f"concurrency {conc}: transformers ...", file=sys.stderr, flush=True)
            ref_res, theirs = run_transformers(hf, prompts, args.max_tokens)
            results.append(ref_res)
            agree[conc] = sum(a == b for a, b in zip(ours, theirs, strict=True)) / conc
        engine.check_integrity()

    print(f"model {model_dir} dtype {dtype} device {device} threads {torch.get_num_threads()}")
    print_table(results, agree)
    out = args.out or Path("bench/results") / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "model": str(model_dir),
        "dtype": str(dtype),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "results": [asdict(r) for r in results],
        "greedy_agreement": {str(k): v for k, v in agree.items()},
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
