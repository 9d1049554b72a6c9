"""The two model paths side by side: native class vs transformers-backed, same checkpoint.

    python -P -m pdserve.bench.model_impl [--model DIR | --size small] [--batch 1 8 32]
                                          [--prefill-len 128] [--rounds 5] [--threads 1]
                                          [--out FILE.json]

Loads one ``ModelRunner`` per path and times steps of the runner itself (forward, logits,
sampling) on identical inputs: a decode step of each batch size (context 128) and one
prefill step of ``--prefill-len`` tokens. The paths alternate round by round and the
median of the rounds is reported, as **CPU time of this process** (``time.process_time``)
on a CPU: on a shared machine other processes change wall time far more than either path
does. On CUDA it is wall time after a synchronize. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.engine.testmodel import SIZES, ensure_test_model

_CONTEXT = 128
_IMPLS = ("native", "transformers")


def _step(batch: int, prefill_len: int, blocks_per_seq: int) -> SchedulerOutput:
    """A decode step of ``batch`` sequences (prefill_len 0) or one prefill chunk."""
    params = SamplingParams(temperature=0.0)
    if prefill_len:
        tokens = [5 + i % 1000 for i in range(prefill_len)]
        chunk = ScheduledChunk("p", tokens, 0, list(range(blocks_per_seq)), True, params, 0)
        return SchedulerOutput([chunk], prefill_len)
    chunks = [
        ScheduledChunk(
            f"r{i}",
            [5],
            _CONTEXT,
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            True,
            params,
            0,
        )
        for i in range(batch)
    ]
    return SchedulerOutput(chunks, batch)


def _time_ms(runner: ModelRunner, step: SchedulerOutput, iters: int) -> float:
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(runner.device)
    clock = time.perf_counter if cuda else time.process_time
    start = clock()
    for _ in range(iters):
        runner.execute(step)
    if cuda:
        torch.cuda.synchronize(runner.device)
    return (clock() - start) / iters * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="native vs transformers model path")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="local Hugging Face model directory")
    src.add_argument("--size", choices=sorted(SIZES), help="generated test model (default small)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefill-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=4, help="steps timed per round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/...)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or ensure_test_model(args.size or "small")
    block_size = 16
    per_seq = -(-max(_CONTEXT + 1, args.prefill_len) // block_size)
    num_blocks = per_seq * max(args.batch)
    runners = {}
    for impl in _IMPLS:
        config = EngineConfig(
            model=str(model_dir),
            model_impl=impl,  # type: ignore[arg-type]
            dtype=args.dtype,
            device=args.device,
            block_size=block_size,
            num_kv_blocks=num_blocks,
            max_model_len=per_seq * block_size,
            max_num_seqs=max(args.batch),
        )
        runners[impl] = ModelRunner(config)
        runners[impl].allocate_kv_cache(num_blocks)
    cases = [(f"decode B={b}", _step(b, 0, per_seq)) for b in args.batch]
    cases.append((f"prefill {args.prefill_len}", _step(1, args.prefill_len, per_seq)))
    rows = []
    for label, step in cases:
        for runner in runners.values():
            _time_ms(runner, step, 2)  # warm-up
        times: dict[str, list[float]] = {impl: [] for impl in _IMPLS}
        for _ in range(args.rounds):
            for impl, runner in runners.items():
                times[impl].append(_time_ms(runner, step, args.iters))
        native, hf = (statistics.median(times[i]) for i in _IMPLS)
        rows.append(
            {"step": label, "native_ms": native, "transformers_ms": hf, "ratio": native / hf}
        )
    runner = runners["native"]
    clock = "wall" if runner.device.type == "cuda" else "cpu"
    print(
        f"model {model_dir} dtype {runner.model_config.dtype} device {runner.device} "
        f"threads {torch.get_num_threads()} ({clock} time, median of {args.rounds} rounds)"
    )
    print(f"{'step':16s} {'native ms':>10s} {'transf. ms':>10s} {'speed ratio':>12s}")
    for r in rows:
        print(
            f"{r['step']:16s} {r['native_ms']:10.1f} {r['transformers_ms']:10.1f} "
            f"{r['ratio']:12.2f}"
        )
    out = args.out or Path("bench/results") / f"model-impl-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "model": str(model_dir),
        "dtype": str(runner.model_config.dtype),
        "device": str(runner.device),
        "threads": torch.get_num_threads(),
        "clock": clock,
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
