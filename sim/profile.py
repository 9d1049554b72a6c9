"""Measure a step-time profile of the real engine on this machine, for ``ProfileCost``:

    python -m pdserve.sim.profile [--size small | --model DIR] [--threads 1]
        [--helper-threads 0 --helper-min-tokens 32] [--out FILE.json]

It times ``LLMEngine.step()`` (scheduler, model runner and output processing: what one
engine iteration costs inside a replica) for
- prefill steps: one prompt of n tokens computed in one chunk, n = 32 .. 2048; a
  least-squares fit T(n) = a + b n + c n^2 / 2 separates the attention (c, per
  token-context pair) from the per-token work;
- decode steps: batches of 1 .. 64 sequences at short context, then 8 sequences at
  growing context (the slope is the cost per context token read).
The step time vs tokens table combines the decode points and the prefill points with
their attention taken out. KV capacity is what the engine would allocate for the local
configs (max_model_len 4096, max_num_seqs 64). The KV transfer is shared memory on one
host here; its bandwidth and per-request latency are options, not measured.
``--helper-threads`` mirrors a pool's ``helper_threads``: steps of at least
``--helper-min-tokens`` tokens run with that many more torch threads, as the engine's
``StepThreads`` does.

``--config YAML --role decode|prefill`` builds the engine as that pool's replicas do
(``deployments.engine_factory``: dtype, torch and helper threads, niceness), which is what
a simulation of that config should be calibrated with.

Prints a table and writes JSON (``StepProfile``). Needs torch (the real engine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pdserve.sim.cost import StepProfile

if TYPE_CHECKING:
    from pdserve.deployments.config import AppConfig, PoolRole

PREFILL_POINTS = (32, 64, 128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (16, 512, 1536)


def _engine(
    model_dir: str, dtype: str, budget: int, pool: tuple[AppConfig, PoolRole] | None = None
):
    """The engine to time (torch: imported late). With ``pool`` = (AppConfig, role) it is
    built as that pool's replicas build theirs (``engine_factory``: the pool's dtype and
    device runtime: torch threads, helper threads, niceness), with room for the profile's
    batches."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    sizes = {
        "block_size": 16,
        "num_kv_blocks": 64 * 4096 // 16 // 4,
        "max_num_batched_tokens": budget,
        "max_num_seqs": 64,
        "max_model_len": 4096,
        "enable_prefix_caching": False,
    }
    if pool is not None:
        from pdserve.deployments.engine_factory import engine_config, runtime_settings

        cfg, role = pool
        config = engine_config(cfg, role, model_dir).model_copy(update=sizes)
        return LLMEngine(config, runtime_settings=runtime_settings(cfg.pool(role)))
    return LLMEngine(
        EngineConfig.model_validate({"model": model_dir, "dtype": dtype, "device": "cpu", **sizes})
    )


def _prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(4, vocab, n).tolist()


def _params(max_tokens: int):
    from pdserve.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@dataclass(frozen=True)
class Threads:
    """Torch threads per step, as the engine's ``StepThreads`` sets them."""

    base: int
    helpers: int = 0
    min_tokens: int = 32

    def apply(self, num_tokens: int) -> None:
        import torch

        torch.set_num_threads(self.base + (self.helpers if num_tokens >= self.min_tokens else 0))


def time_prefill(engine, n: int, repeats: int, rng: np.random.Generator) -> float:
    vocab = engine.vocab_size
    times = []
    for i in range(repeats):
        engine.add_request(f"p{n}-{i}-{time.perf_counter()}", _prompt(rng, n, vocab), _params(1))
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)


def time_decode(engine, batch: int, context: int, steps: int, rng: np.random.Generator) -> float:
    vocab = engine.vocab_size
    for i in range(batch):
        engine.add_request(
            f"d{batch}-{context}-{i}-{time.perf_counter()}",
            _prompt(rng, context, vocab),
            _params(steps + 2),
        )
    engine.step()  # the prompts (one step: the budget holds them all)
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[:steps])


def measure(
    model_dir: str,
    dtype: str,
    repeats: int,
    threads: Threads | None,
    transfer_bytes_per_s: float,
    transfer_latency_s: float,
    pool: tuple[AppConfig, PoolRole] | None = None,
) -> tuple[StepProfile, dict]:
    """``threads`` None: the engine's own runtime sets them per step (a pool's engine)."""
    rng = np.random.default_rng(0)
    budget = max(PREFILL_POINTS[-1], 64 * CONTEXTS[-1])
    engine = _engine(model_dir, dtype, budget, pool)
    apply = threads.apply if threads is not None else (lambda n: None)
    time_prefill(engine, 64, 2, rng)  # warm-up: first-call allocations
    prefill, decode, ctx = {}, {}, {}
    for n in PREFILL_POINTS:
        apply(n)
        prefill[n] = time_prefill(engine, n, repeats, rng)
    for b in DECODE_BATCHES:
        apply(b)
        decode[b] = time_decode(engine, b, 16, 8, rng)
    apply(8)
    for c in CONTEXTS:
        ctx[c] = time_decode(engine, 8, c, 8, rng)

    tokens = np.array(PREFILL_POINTS, dtype=np.float64)
    design = np.stack([np.ones_like(tokens), tokens, tokens * tokens / 2], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(
        design, np.array([prefill[k] for k in PREFILL_POINTS]), rcond=None
    )
    attn = max(float(c), 0.0)
    xs = np.array([8 * k for k in CONTEXTS], dtype=np.float64)
    slope = float(np.polyfit(xs, np.array([ctx[k] for k in CONTEXTS]), 1)[0])
    ctx_per_token = max(slope, 0.0)

    table: dict[int, float] = {}
    for bsz, t in decode.items():
        table[bsz] = t - ctx_per_token * bsz * 16
    for k, t in prefill.items():
        if k > DECODE_BATCHES[-1]:
            table[k] = t - attn * k * k / 2
    points = sorted(table)
    cfg = engine.model_config
    kv_bytes = cfg.kv_planes * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    kv_bytes *= engine.kv_cache.element_size()
    capacity = engine.runner.profile_num_blocks() * engine.block_size
    runtime = f"{pool[1]} pool runtime" if not threads and pool is not None else threads
    profile = StepProfile(
        token_points=tuple(points),
        token_seconds=tuple(max(table[p], 1e-6) for p in points),
        attn_s_per_pair=attn,
        ctx_s_per_token=ctx_per_token,
        kv_bytes_per_token=int(kv_bytes),
        kv_capacity_tokens=int(capacity),
        transfer_bytes_per_s=transfer_bytes_per_s,
        transfer_latency_s=transfer_latency_s,
        num_layers=int(cfg.num_layers),
        source=f"{model_dir} dtype {cfg.dtype} {runtime}",
    )
    raw = {"prefill_s": prefill, "decode_s": decode, "decode8_ctx_s": ctx, "fit_a_b": [a, b]}
    return profile, raw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.sim.profile", description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="local Hugging Face model directory")
    src.add_argument("--size", default="small", help="generated test model (default small)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (a replica's num_cpus)")
    p.add_argument("--helper-threads", type=int, default=0, help="the pool's helper_threads")
    p.add_argument("--helper-min-tokens", type=int, default=32, help="the pool's helper_min_tokens")
    p.add_argument(
        "--config",
        type=Path,
        help="AppConfig YAML: build the engine as this config's --role replicas do (its "
        "dtype and device runtime; --threads/--helper-* are then ignored)",
    )
    p.add_argument("--role", choices=["prefill", "decode"], default="decode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transfer-gbps", type=float, default=2.0, help="KV copy GB/s (shm)")
    p.add_argument("--transfer-latency-ms", type=float, default=5.0, help="per remote prefill")
    p.add_argument("--out", type=Path, default=Path("bench/results/sim-profile.json"))
    args = p.parse_args(argv)
    import torch

    from pdserve.engine.testmodel import ensure_test_model

    torch.set_num_threads(args.threads)
    model_dir = str(args.model or ensure_test_model(args.size))
    pool = None
    threads: Threads | None = Threads(args.threads, args.helper_threads, args.helper_min_tokens)
    if args.config is not None:
        from pdserve.deployments.config import AppConfig

        pool, threads = (AppConfig.from_yaml(args.config), args.role), None
    profile, raw = measure(
        model_dir,
        args.dtype,
        args.repeats,
        threads,
        args.transfer_gbps * 1e9,
        args.transfer_latency_ms / 1e3,
        pool,
    )
    print(f"{'tokens/step':>12}{'step ms':>10}")
    for x, y in zip(profile.token_points, profile.token_seconds, strict=True):
        print(f"{x:>12}{y * 1e3:>10.2f}")
    print(f"attention {profile.attn_s_per_pair * 1e9:.2f} ns/pair, decode context "
          f"{profile.ctx_s_per_token * 1e6:.3f} us/token, KV {profile.kv_bytes_per_token} B/token, "
          f"capacity {profile.kv_capacity_tokens} tokens")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(profile) | {
        "raw": {
            k: {str(i): v for i, v in d.items()} if isinstance(d, dict) else d
            for k, d in raw.items()
        }
    }
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
