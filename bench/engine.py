"""Engine vs ``transformers.generate`` on the same model and prompts, two workloads.

    python -m pdserve.bench.engine [--model DIR | --size small] [--workload fixed|mixed|both]
                           [--concurrency 1 8 32] [--prompt-len 128] [--max-tokens 32]
                           [--mixed-concurrency 8 32] [--mixed-prompt-len 16 256]
                           [--mixed-max-tokens 8 64] [--mixed-requests 32]
                           [--quantization int8|int8-weight-only|fp8]
                           [--model-impl auto|native|transformers]
                           [--threads N] [--seed 0] [--out FILE.json]

``fixed``: for each concurrency c, c prompts of one length, each run to ``--max-tokens``
greedy tokens (eos ignored). Static batching wastes nothing here.

``mixed`` (a serving-like workload): for each concurrency c, the same ``--mixed-requests``
requests with prompt lengths and output lengths drawn uniformly from the given ranges (fixed
seed), all arriving at time 0. pdserve keeps at most c requests in flight and admits the next
one as soon as one finishes (continuous batching). transformers serves them in arrival order
in static batches of c: each batch is left-padded to its longest prompt (with an attention
mask) and, since ``generate`` has one ``max_new_tokens``, runs to the batch's longest output;
only each request's own tokens count as output.

Both systems run greedy, same dtype, same torch threads. Prints one table per workload and
writes JSON with, per system and concurrency: output tokens/s, mean time to first token
(from the workload's start), mean per-token decode latency, the process's CPU time and
minor page faults over the run (shown per output token: steadier than the wall clock on a
shared machine), and how far greedy tokens agree (the share of output tokens before the
first difference). In float32 pdserve agrees with
transformers 100%. In half precision every implementation rounds differently and the texts
part at some near-tie, so agreement is reported against two references: transformers in the
same dtype (``vs hf``), and transformers in float32 (``vs fp32``, untimed, for both systems):
pdserve's ``vs fp32`` at or above transformers' own says the difference is rounding noise,
below it says pdserve's numerics are worse. ``--skip-fp32-reference`` leaves it out.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.testmodel import SIZES, ensure_test_model


@dataclass(frozen=True)
class Job:
    """One benchmark request: prompt token ids and how many tokens it generates."""

    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Result:
    workload: str  # "fixed" | "mixed"
    system: str  # "pdserve" | "transformers"
    concurrency: int
    num_requests: int
    output_tokens: int
    output_tokens_per_s: float
    prefill_latency_s: float  # mean time to first token, from the workload's start
    decode_latency_s_per_token: float  # mean time between a request's output tokens
    wall_s: float
    # The process's CPU time (user + system) and minor page faults over the run: on a
    # shared machine these move far less with the load than the wall-clock figures.
    cpu_s: float
    minor_faults: int


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids below 4 are the test tokenizers' special tokens; harmless for other models too.
    return torch.randint(4, vocab, (n, length), generator=g).tolist()


def fixed_jobs(n: int, length: int, max_tokens: int, vocab: int, seed: int) -> list[Job]:
    return [Job(p, max_tokens) for p in make_prompts(n, length, vocab, seed)]


def mixed_jobs(
    n: int,
    prompt_len: tuple[int, int],
    max_tokens: tuple[int, int],
    vocab: int,
    seed: int,
) -> list[Job]:
    """``n`` requests with uniform prompt and output lengths in the inclusive ranges."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(prompt_len[0], prompt_len[1] + 1, (n,), generator=g).tolist()
    outs = torch.randint(max_tokens[0], max_tokens[1] + 1, (n,), generator=g).tolist()
    return [
        Job(torch.randint(4, vocab, (length,), generator=g).tolist(), out)
        for length, out in zip(lens, outs, strict=True)
    ]


@dataclass(frozen=True)
class Usage:
    """The process's CPU time (user + system) and minor page faults so far."""

    cpu_s: float
    minor_faults: int

    @classmethod
    def now(cls) -> Usage:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return cls(ru.ru_utime + ru.ru_stime, ru.ru_minflt)


def _summarize(
    workload: str,
    system: str,
    concurrency: int,
    jobs: list[Job],
    wall: float,
    ttft: list[float],
    decode: list[float],
    since: Usage,
) -> Result:
    total = sum(j.max_tokens for j in jobs)
    usage = Usage.now()
    return Result(
        workload=workload,
        system=system,
        concurrency=concurrency,
        num_requests=len(jobs),
        output_tokens=total,
        output_tokens_per_s=total / wall,
        prefill_latency_s=statistics.mean(ttft),
        decode_latency_s_per_token=statistics.mean(decode),
        wall_s=wall,
        cpu_s=usage.cpu_s - since.cpu_s,
        minor_faults=usage.minor_faults - since.minor_faults,
    )


def now() -> float:
    """A timestamp taken after the GPU finished what was queued: CUDA kernels run
    asynchronously, so an unsynchronised clock would time their launch, not their work."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def run_engine(
    engine: LLMEngine, jobs: list[Job], concurrency: int, workload: str = "fixed"
) -> tuple[Result, list[list[int]]]:
    """Closed loop: at most ``concurrency`` requests in flight, the next admitted on finish."""
    usage = Usage.now()
    start = now()
    ids = [f"bench-{start}-{i}" for i in range(len(jobs))]
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    next_job = 0
    budget = sum(len(j.prompt) + j.max_tokens for j in jobs)
    for _ in range(10 * (len(jobs) + 1) * budget):
        while next_job < len(jobs) and next_job - len(done) < concurrency:
            job = jobs[next_job]
            params = SamplingParams(temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True)
            engine.add_request(ids[next_job], job.prompt, params)
            next_job += 1
        if len(done) == len(jobs):
            break
        for out in engine.step():
            t = now()
            if out.new_token_ids:
                first.setdefault(out.request_id, t)
            if out.finished:
                done[out.request_id] = t
                tokens[out.request_id] = out.token_ids
    else:
        raise RuntimeError("engine did not finish the benchmark requests")
    wall = max(done.values()) - start
    ttft = [first[r] - start for r in ids]
    decode = [
        (done[r] - first[r]) / max(j.max_tokens - 1, 1) for r, j in zip(ids, jobs, strict=True)
    ]
    result = _summarize(workload, "pdserve", concurrency, jobs, wall, ttft, decode, usage)
    return result, [tokens[r] for r in ids]


def run_transformers(
    model: Any,  # a transformers causal LM: its stubs split generate() from PreTrainedModel
    jobs: list[Job],
    concurrency: int,
    workload: str = "fixed",
) -> tuple[Result, list[list[int]]]:
    """Static batching: batches of ``concurrency`` jobs in order, each left-padded to its
    longest prompt and generated to its longest output."""
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Records when each step's logits are ready (the first one right after prefill)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(now())
            return scores

    pad = 0
    tokens: list[list[int]] = []
    ttft: list[float] = []
    decode: list[float] = []
    usage = Usage.now()
    start = now()
    for b in range(0, len(jobs), concurrency):
        batch = jobs[b : b + concurrency]
        width = max(len(j.prompt) for j in batch)
        ids = torch.tensor([[pad] * (width - len(j.prompt)) + j.prompt for j in batch])
        mask = torch.tensor([[0] * (width - len(j.prompt)) + [1] * len(j.prompt) for j in batch])
        new = max(j.max_tokens for j in batch)
        clock = StepClock()
        gc = GenerationConfig(
            max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=pad
        )
        with torch.inference_mode():
            out = model.generate(
                ids.to(model.device),
                attention_mask=mask.to(model.device),
                generation_config=gc,
                logits_processor=LogitsProcessorList([clock]),
            )
        for row, job in enumerate(batch):
            tokens.append(out[row, width : width + job.max_tokens].tolist())
            ttft.append(clock.times[0] - start)
            # A row's last own token is ready at step max_tokens - 1's logits.
            last = clock.times[min(job.max_tokens, len(clock.times)) - 1]
            decode.append((last - clock.times[0]) / max(job.max_tokens - 1, 1))
    wall = now() - start
    result = _summarize(workload, "transformers", concurrency, jobs, wall, ttft, decode, usage)
    return result, tokens


# Agreement keys: (system, reference) -> share of tokens before the first difference.
Agreement = dict[int, dict[str, float]]


def print_table(title: str, results: list[Result], agree: Agreement) -> None:
    print(f"\n{title}")
    header = (
        f"{'system':<13}{'conc':>5}{'reqs':>6}{'out tok':>8}{'out tok/s':>11}{'speedup':>9}"
        f"{'ttft ms':>10}{'decode ms/tok':>15}{'cpu ms/tok':>12}{'faults/tok':>12}"
        f"{'vs hf':>8}{'vs fp32':>9}"
    )
    print(header)
    print("-" * len(header))
    base = {r.concurrency: r.output_tokens_per_s for r in results if r.system == "transformers"}

    def cell(conc: int, key: str, width: int) -> str:
        value = agree.get(conc, {}).get(key)
        return f"{value:>{width}.0%}" if value is not None else f"{'-':>{width}}"

    for r in results:
        ref = base.get(r.concurrency)
        speed = f"{r.output_tokens_per_s / ref:>8.2f}x" if ref else f"{'':>9}"
        vs_hf = (
            cell(r.concurrency, "pdserve_vs_transformers", 8)
            if r.system == "pdserve"
            else (f"{'-':>8}")
        )
        print(
            f"{r.system:<13}{r.concurrency:>5}{r.num_requests:>6}{r.output_tokens:>8}"
            f"{r.output_tokens_per_s:>11.1f}{speed}"
            f"{r.prefill_latency_s * 1e3:>10.1f}{r.decode_latency_s_per_token * 1e3:>15.2f}"
            f"{r.cpu_s * 1e3 / r.output_tokens:>12.2f}{r.minor_faults / r.output_tokens:>12.0f}"
            f"{vs_hf}{cell(r.concurrency, f'{r.system}_vs_fp32', 9)}"
        )


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Share of output tokens produced before the two systems' first disagreement.

    Greedy texts agree token for token in float32; in bfloat16 the two implementations
    round differently, a near-tie flips somewhere and the texts part from there on, so a
    whole-request comparison would say little. This counts how far they agree."""
    same = total = 0
    for a, b in zip(ours, theirs, strict=True):
        pairs = enumerate(zip(a, b, strict=False))
        prefix = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
        same += prefix
        total += max(len(a), len(b))
    return same / total if total else 1.0


def _run_workload(
    name: str,
    engine: LLMEngine,
    hf: torch.nn.Module | None,
    plans: list[tuple[int, list[Job]]],
    hf_fp32: torch.nn.Module | None = None,
) -> tuple[list[Result], Agreement]:
    """Each plan through pdserve and transformers (timed), and through transformers in
    float32 (untimed, only for the agreement) when ``hf_fp32`` is given."""
    results: list[Result] = []
    agree: Agreement = {}
    for conc, jobs in plans:
        print(f"{name} c={conc} ({len(jobs)} requests): pdserve ...", file=sys.stderr, flush=True)
        res, ours = run_engine(engine, jobs, conc, name)
        results.append(res)
        agree[conc] = {}
        theirs = None
        if hf is not None:
            print(f"{name} c={conc}: transformers ...", file=sys.stderr, flush=True)
            ref_res, theirs = run_transformers(hf, jobs, conc, name)
            results.append(ref_res)
            agree[conc]["pdserve_vs_transformers"] = _agreement(ours, theirs)
        if hf_fp32 is not None:
            print(f"{name} c={conc}: transformers float32 ...", file=sys.stderr, flush=True)
            _, exact = run_transformers(hf_fp32, jobs, conc, name)
            agree[conc]["pdserve_vs_fp32"] = _agreement(ours, exact)
            if theirs is not None:
                agree[conc]["transformers_vs_fp32"] = _agreement(theirs, exact)
        engine.check_integrity()
    return results, agree


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pdserve engine vs transformers.generate")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="local Hugging Face model directory")
    src.add_argument("--size", choices=sorted(SIZES), help="generated test model (default small)")
    parser.add_argument("--workload", choices=["fixed", "mixed", "both"], default="both")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--mixed-concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--mixed-prompt-len", type=int, nargs=2, default=[16, 256])
    parser.add_argument("--mixed-max-tokens", type=int, nargs=2, default=[8, 64])
    parser.add_argument("--mixed-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the mixed workload")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--quantization",
        choices=["int8", "int8-weight-only", "fp8"],
        help="quantize the float checkpoint's linears at load (EngineConfig.quantization)",
    )
    parser.add_argument(
        "--model-impl",
        choices=["auto", "native", "transformers"],
        default="auto",
        help="model code (EngineConfig.model_impl): pdserve's native class or transformers'",
    )
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads (default: torch's own choice)"
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--skip-fp32-reference",
        action="store_true",
        help="in half precision, do not also compare both systems with transformers in float32",
    )
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/...)")
    args = parser.parse_args(argv)
    for flag in ("mixed_prompt_len", "mixed_max_tokens"):
        lo, hi = getattr(args, flag)
        if not 1 <= lo <= hi:
            parser.error(f"--{flag.replace('_', '-')}: need 1 <= MIN <= MAX")
    if args.threads:
        torch.set_num_threads(args.threads)
    fixed = args.workload in ("fixed", "both")
    mixed = args.workload in ("mixed", "both")

    model_dir = args.model or ensure_test_model(args.size or "small")
    max_conc = max(
        [*(args.concurrency if fixed else []), *(args.mixed_concurrency if mixed else [])]
    )
    seq_len = max(
        args.prompt_len + args.max_tokens if fixed else 0,
        args.mixed_prompt_len[1] + args.mixed_max_tokens[1] if mixed else 0,
    )
    blocks = max_conc * math.ceil(seq_len / args.block_size) + 8
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype=args.dtype,
            device=args.device,
            quantization=args.quantization,
            model_impl=args.model_impl,
            block_size=args.block_size,
            num_kv_blocks=blocks,
            max_num_seqs=max(max_conc, 1),
            max_model_len=seq_len,
            enable_prefix_caching=False,  # distinct random prompts: nothing to reuse anyway
        )
    )
    dtype = engine.model_config.dtype
    # object first: the engine types its runner by a protocol that ModelRunner's frozen
    # SampledToken does not match yet, so narrowing from it would read as unreachable.
    runner: object = engine.runner
    assert isinstance(runner, ModelRunner)
    device = runner.device
    vocab = engine.model_config.vocab_size
    hf = hf_fp32 = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        # typeshed's functools.wraps leaves transformers' PreTrainedModel.to unbound.
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
        if dtype != torch.float32 and not args.skip_fp32_reference:
            hf_fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            hf_fp32 = hf_fp32.to(device).eval()  # type: ignore[arg-type]

    # Warm-up (first-call allocations, lazy imports) outside the measurements.
    warm = fixed_jobs(2, 16, 2, vocab, seed=99)
    run_engine(engine, warm, 2)
    if hf is not None:
        run_transformers(hf, warm, 2)

    report: dict[str, object] = {
        "model": str(model_dir),
        "dtype": str(dtype),
        "device": str(device),
        "model_impl": engine.model_config.impl,
        "torch_threads": torch.get_num_threads(),
        "workloads": {},
    }
    tables: list[tuple[str, list[Result], Agreement]] = []
    if fixed:
        plans = [
            (c, fixed_jobs(c, args.prompt_len, args.max_tokens, vocab, seed=c))
            for c in args.concurrency
        ]
        results, agree = _run_workload("fixed", engine, hf, plans, hf_fp32)
        title = f"fixed: prompt {args.prompt_len}, output {args.max_tokens} tokens"
        tables.append((title, results, agree))
        report["workloads"]["fixed"] = {  # type: ignore[index]
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "results": [asdict(r) for r in results],
            "greedy_agreement": {str(k): v for k, v in agree.items()},
        }
    if mixed:
        plans = [
            (
                c,
                mixed_jobs(
                    args.mixed_requests,
                    tuple(args.mixed_prompt_len),
                    tuple(args.mixed_max_tokens),
                    vocab,
                    seed=args.seed,
                ),
            )
            for c in args.mixed_concurrency
        ]
        results, agree = _run_workload("mixed", engine, hf, plans, hf_fp32)
        lo_p, hi_p = args.mixed_prompt_len
        lo_o, hi_o = args.mixed_max_tokens
        title = (
            f"mixed: prompt U[{lo_p},{hi_p}], output U[{lo_o},{hi_o}], "
            f"{args.mixed_requests} requests, seed {args.seed}"
        )
        tables.append((title, results, agree))
        report["workloads"]["mixed"] = {  # type: ignore[index]
            "prompt_len_range": [lo_p, hi_p],
            "max_tokens_range": [lo_o, hi_o],
            "num_requests": args.mixed_requests,
            "seed": args.seed,
            "results": [asdict(r) for r in results],
            "greedy_agreement": {str(k): v for k, v in agree.items()},
        }

    impl = engine.model_config.impl
    threads = torch.get_num_threads()
    print(f"model {model_dir} ({impl}) dtype {dtype} device {device} threads {threads}")
    for title, results, agree in tables:
        print_table(title, results, agree)
    out = args.out or Path("bench/results") / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
