"""Where a decode step's CPU time goes, per quantization scheme and concurrency.

    python -P -m pdserve.bench.step_split [--size small] [--concurrency 1 8]
        [--schemes none int8 int8-weight-only] [--rounds 3] [--steps 24]

One ``LLMEngine`` per scheme (as ``bench.quant_engine``: ``+head`` adds
``quantize_lm_head``), one torch thread. The decoder's linears (qkv, o, gate_up, down), its
norms, and the ops the Llama layers call through ``kernels.ops`` (rotary, KV write, decode
attention, SiLU-and-mul, the logits projection) are wrapped to add up their thread CPU
time; everything else in a step (embedding, sampling, scheduling, the Python step loop)
is the rest. Prints, per concurrency and scheme, the mean CPU milliseconds of a decode
step and of each part, from the round with the fastest steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from pdserve.bench.engine import make_prompts
from pdserve.bench.quant_engine import PROMPT_LEN
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models import llama
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.testmodel import SIZES, ensure_test_model
from pdserve.kernels import ops

OPS = ["apply_rotary", "write_kv", "paged_decode_attention", "silu_and_mul", "linear_float32"]
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")

_spent: defaultdict[str, float] = defaultdict(float)


def _timed(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[part] += time.thread_time() - start

    return wrapper


def _instrument(engine: LLMEngine) -> None:
    runner = engine.runner
    assert isinstance(runner, ModelRunner)  # one process, no tensor parallelism
    for name, module in runner.model.named_modules():
        if name.endswith(LINEARS):
            module.forward = _timed("decoder linears", module.forward)
        elif name.endswith(NORMS) or name == "model.norm":
            module.forward = _timed("norms", module.forward)


def _decode_split(engine: LLMEngine, concurrency: int, steps: int, tag: str) -> dict[str, float]:
    """Mean CPU ms per decode step, in all and per part, of ``concurrency`` requests."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i, prompt in enumerate(make_prompts(concurrency, PROMPT_LEN, vocab, seed=concurrency)):
        engine.add_request(f"{tag}-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < concurrency:  # the prefill steps, not counted
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    _spent.clear()
    times = []
    while engine.has_unfinished_requests():
        start = time.process_time()
        engine.step()
        times.append(time.process_time() - start)
    split = {part: spent * 1e3 / len(times) for part, spent in _spent.items()}
    split["step"] = statistics.mean(times) * 1e3
    split["rest"] = split["step"] - sum(v for k, v in split.items() if k != "step")
    return split


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--schemes", nargs="+", default=["none", "int8", "int8-weight-only"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    wrapped = types.ModuleType("ops_timed")
    wrapped.__dict__.update(ops.__dict__)
    for name in OPS:
        setattr(wrapped, name, _timed(name, getattr(ops, name)))
    llama.ops = wrapped
    model, conc = ensure_test_model(args.size), max(args.concurrency)
    engines = {}
    for s in args.schemes:
        engines[s] = LLMEngine(
            EngineConfig(
                model=str(model),
                quantization=None if s.startswith("none") else s.removesuffix("+head"),
                quantize_lm_head=s.endswith("+head"),
                block_size=16,
                num_kv_blocks=conc * ((PROMPT_LEN + args.steps) // 16 + 1) + 8,
                max_num_seqs=conc,
                max_model_len=PROMPT_LEN + args.steps,
                enable_prefix_caching=False,
            )
        )
        _instrument(engines[s])
        _decode_split(engines[s], 2, 2, f"warm-{s}")
    print(f"{args.size}, 1 thread, load average {os.getloadavg()}")
    for c in args.concurrency:
        for s, engine in engines.items():
            splits = [_decode_split(engine, c, args.steps, f"r{r}-{s}") for r in range(args.rounds)]
            best = min(splits, key=lambda sp: sp["step"])
            parts = ", ".join(f"{k} {v:.2f}" for k, v in best.items() if k != "step")
            print(f"c{c} {s:<22} step {best['step']:.1f} ms CPU: {parts}")


if __name__ == "__main__":
    main()
