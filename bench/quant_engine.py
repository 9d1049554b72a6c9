"""Decode speed of one model served in bf16 and int8-quantized at load, in one process.

    python -P -m pdserve.bench.quant_engine [--size small] [--concurrency 1 8 32]
        [--schemes none int8 int8-weight-only] [--rounds 3] [--steps 24] [--threads 1]
        [--prefill-len 256] [--out FILE.json]

One ``LLMEngine`` per scheme (``EngineConfig.quantization``; ``none`` is the checkpoint's
dtype; a ``+head`` suffix adds ``quantize_lm_head``), all loaded before any timing. Each
round runs, for every concurrency c and every scheme (the scheme order rotates from round
to round), c random 128-token prompts to ``--steps`` greedy tokens and times every decode
step (the steps after each request has its first token; each makes c tokens): its wall
time and this process's CPU time. With one torch thread the CPU time is what the step
cost this engine however many other jobs share the machine; the wall time is what a
client saw. Each round also times, per scheme, the prefill of one ``--prefill-len``-token
prompt (until its first token). Prints, per concurrency and scheme, the medians over all
rounds' steps as decode tokens/s, and the ratio to the first scheme, then prefill tokens/s
the same way; writes JSON with every round's medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from pdserve.bench.engine import make_prompts
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.testmodel import SIZES, ensure_test_model

PROMPT_LEN = 128


def decode_steps(
    engine: LLMEngine, concurrency: int, steps: int, tag: str
) -> list[tuple[float, float]]:
    """(wall s, CPU s) of every decode step of ``concurrency`` requests run together."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(concurrency, PROMPT_LEN, vocab, seed=concurrency)):
        engine.add_request(f"{tag}-{i}", prompt, params)
    started: set[str] = set()
    finished = 0
    times: list[tuple[float, float]] = []
    while finished < concurrency:
        decoding = len(started) == concurrency
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = engine.step()
        if decoding:
            times.append((time.perf_counter() - wall, time.process_time() - cpu))
        for out in outputs:
            if out.new_token_ids:
                started.add(out.request_id)
            finished += int(out.finished)
    return times


def prefill_time(engine: LLMEngine, length: int, tag: str) -> tuple[float, float]:
    """(wall s, CPU s) from adding one ``length``-token prompt to its first token."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(tag, make_prompts(1, length, vocab, seed=length)[0], params)
    wall, cpu = time.perf_counter(), time.process_time()
    while not any(out.new_token_ids for out in engine.step()):
        pass
    times = (time.perf_counter() - wall, time.process_time() - cpu)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--schemes", nargs="+", default=["none", "int8", "int8-weight-only"],
        choices=[f"{s}{h}" for s in ("none", "int8", "int8-weight-only", "fp8")
                 for h in ("", "+head")],
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24, help="greedy tokens per request")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--prefill-len", type=int, default=256, help="prompt tokens timed")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = ensure_test_model(args.size)
    conc = max(args.concurrency)
    engines = {
        s: LLMEngine(
            EngineConfig(
                model=str(model),
                quantization=None if s.startswith("none") else s.removesuffix("+head"),
                quantize_lm_head=s.endswith("+head"),
                block_size=16,
                num_kv_blocks=conc * ((PROMPT_LEN + args.steps) // 16 + 1)
                + args.prefill_len // 16
                + 8,
                max_num_seqs=conc,
                max_model_len=max(PROMPT_LEN + args.steps, args.prefill_len + 1),
                enable_prefix_caching=False,
            )
        )
        for s in args.schemes
    }
    for s, engine in engines.items():
        decode_steps(engine, 2, 2, f"warm-{s}")
    load = [os.getloadavg()[0]]
    steps: dict[tuple[int, str], list[tuple[float, float]]] = {}
    rounds: list[dict[str, object]] = []
    prefills: dict[str, list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        order = args.schemes[r % len(args.schemes) :] + args.schemes[: r % len(args.schemes)]
        for c in args.concurrency:
            for s in order:
                times = decode_steps(engines[s], c, args.steps, f"r{r}-c{c}-{s}")
                steps.setdefault((c, s), []).extend(times)
                rounds.append(
                    {"round": r, "concurrency": c, "scheme": s,
                     "wall_ms": statistics.median(t[0] for t in times) * 1e3,
                     "cpu_ms": statistics.median(t[1] for t in times) * 1e3}
                )  # fmt: skip
        for s in order:
            prefills.setdefault(s, []).append(
                prefill_time(engines[s], args.prefill_len, f"r{r}-prefill-{s}")
            )
        load.append(os.getloadavg()[0])
    print(f"{args.size}, {args.threads} thread(s), load average (1 min) over the rounds {load}")
    print(f"{'conc':>4} {'scheme':<17} {'tok/s wall':>10} {'x':>5} {'tok/s cpu':>10} {'x':>5}")
    summary = []
    for c in args.concurrency:
        base = None
        for s in args.schemes:
            wall = c / statistics.median(t[0] for t in steps[(c, s)])
            cpu = c / statistics.median(t[1] for t in steps[(c, s)])
            base = base or (wall, cpu)
            ratios = f"{wall / base[0]:>5.2f} {cpu:>10.1f} {cpu / base[1]:>5.2f}"
            print(f"{c:>4} {s:<17} {wall:>10.1f} {ratios}")
            summary.append({"concurrency": c, "scheme": s, "tok_s_wall": wall, "tok_s_cpu": cpu})
    print(f"prefill of {args.prefill_len} tokens, tokens/s (median over rounds):")
    base = None
    for s in args.schemes:
        wall = args.prefill_len / statistics.median(t[0] for t in prefills[s])
        cpu = args.prefill_len / statistics.median(t[1] for t in prefills[s])
        base = base or (wall, cpu)
        ratios = f"{wall / base[0]:>5.2f} {cpu:>10.1f} {cpu / base[1]:>5.2f}"
        print(f"{'pre':>4} {s:<17} {wall:>10.1f} {ratios}")
        summary.append({"prefill_len": args.prefill_len, "scheme": s, "tok_s_wall": wall,
                        "tok_s_cpu": cpu})  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"load": load, "summary": summary, "rounds": rounds}))


if __name__ == "__main__":
    main()
