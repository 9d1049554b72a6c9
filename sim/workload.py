"""Simulated workloads: arrival processes, prompt/output length distributions shaped like
public traces, and replay of ``bench.serve --save-requests`` output.

The trace shapes are generated from a seed (no data files): log-normal lengths whose
medians and spreads follow what the public traces report:

- ``chat``: ShareGPT conversations as used by vLLM's and DistServe's benchmarks (prompts of
  a few hundred tokens with a long tail, outputs of about 200);
- ``summarisation``: LongBench / arXiv-summarisation style (prompts of thousands of tokens,
  outputs of a few hundred);
- ``code``: Azure's code-completion trace as reported by Splitwise (prompts around 1.5k
  tokens, outputs of a dozen or so).

Everything is deterministic for a seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.sim.request import SimRequest


@dataclass(frozen=True)
class LogNormalLengths:
    """Token lengths: exp(N(log(median), sigma)), clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(math.log(self.median), self.sigma, n)
        return np.clip(np.rint(raw), self.lo, self.hi).astype(np.int64)


@dataclass(frozen=True)
class TraceShape:
    name: str
    prompt: LogNormalLengths
    output: LogNormalLengths


TRACES: dict[str, TraceShape] = {
    "chat": TraceShape(
        "chat", LogNormalLengths(500, 0.9, 16, 4096), LogNormalLengths(200, 0.8, 8, 1024)
    ),
    "summarisation": TraceShape(
        "summarisation",
        LogNormalLengths(3000, 0.5, 512, 8000),
        LogNormalLengths(200, 0.5, 32, 512),
    ),
    "code": TraceShape(
        "code", LogNormalLengths(1500, 0.6, 64, 8000), LogNormalLengths(13, 0.9, 2, 256)
    ),
}


def trace(name: str) -> TraceShape:
    try:
        return TRACES[name]
    except KeyError:
        raise ValueError(f"unknown trace {name!r}; choose from {sorted(TRACES)}") from None


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    return np.cumsum(rng.exponential(1.0 / rate, n))


def gamma_arrivals(rng: np.random.Generator, rate: float, n: int, cv: float) -> np.ndarray:
    """Bursty renewal arrivals: gamma inter-arrival times with mean 1/rate and coefficient
    of variation ``cv`` (1 = Poisson; AlpaServe and DistServe use this to model bursts)."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be > 0, got rate={rate}, cv={cv}")
    shape = 1.0 / (cv * cv)
    return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), n))


def varying_rate_arrivals(
    rng: np.random.Generator, rate_at: Callable[[float], float], peak: float, duration_s: float
) -> np.ndarray:
    """Non-homogeneous Poisson arrivals over [0, duration_s) by thinning (a day's curve)."""
    if peak <= 0:
        raise ValueError(f"peak rate must be > 0, got {peak}")
    n = int(peak * duration_s * 1.2) + 100
    times = np.cumsum(rng.exponential(1.0 / peak, n))
    times = times[times < duration_s]
    keep = rng.random(len(times)) * peak < np.array([rate_at(t) for t in times])
    return times[keep]


def diurnal(base: float, peak: float, period_s: float) -> Callable[[float], float]:
    """A day compressed into ``period_s``: a trough of ``base`` and one peak at mid-period."""
    return lambda t: base + (peak - base) * 0.5 * (1 - math.cos(2 * math.pi * t / period_s))


def make_requests(
    shape: TraceShape, arrivals: np.ndarray, rng: np.random.Generator
) -> list[SimRequest]:
    n = len(arrivals)
    prompts = shape.prompt.sample(rng, n)
    outputs = shape.output.sample(rng, n)
    return [
        SimRequest(i, float(t), int(p), int(o))
        for i, (t, p, o) in enumerate(zip(arrivals, prompts, outputs, strict=True))
    ]


def generate(
    name: str, rate: float, num_requests: int, seed: int = 0, burst_cv: float = 1.0
) -> list[SimRequest]:
    """``num_requests`` requests of trace ``name`` at ``rate`` req/s (bursty if cv > 1)."""
    rng = np.random.default_rng(seed)
    times = (
        poisson_arrivals(rng, rate, num_requests)
        if burst_cv == 1.0
        else gamma_arrivals(rng, rate, num_requests, burst_cv)
    )
    return make_requests(trace(name), times - times[0], rng)


def fixed_lengths(
    rate: float, num_requests: int, prompt: int, output: int, seed: int = 0
) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    times = poisson_arrivals(rng, rate, num_requests)
    return [SimRequest(i, float(t - times[0]), prompt, output) for i, t in enumerate(times)]


@dataclass(frozen=True)
class ReplayedRun:
    """Requests of a ``bench.serve --save-requests`` run, and what the client measured."""

    requests: list[SimRequest]
    measured_ttft: list[float]
    measured_tpot: list[float]
    config: dict


def replay(path: str | Path, endpoint: str | None = None) -> ReplayedRun:
    """Requests as ``bench.serve`` sent them (send time, prompt and output tokens).

    Failed requests are replayed with the output length the run asked for, when known."""
    report = json.loads(Path(path).read_text())
    runs = report.get("requests")
    if not runs:
        raise ValueError(f"{path}: no per-request records; run bench.serve --save-requests")
    name = endpoint or next(iter(runs))
    if name not in runs:
        raise ValueError(f"{path}: no endpoint {name!r}; it has {sorted(runs)}")
    records = runs[name]
    asked = str(report.get("config", {}).get("output_len", ""))
    default_out = int(asked.split(":")[1]) if asked.startswith("fixed:") else 1
    reqs: list[SimRequest] = []
    ttft: list[float] = []
    tpot: list[float] = []
    for rec in sorted(records, key=lambda r: r["send_time"]):
        out = rec["output_tokens"] or default_out
        reqs.append(SimRequest(rec["index"], rec["send_time"], rec["prompt_tokens"], out))
        if rec.get("ok") and rec.get("ttft") is not None:
            ttft.append(rec["ttft"])
        if rec.get("tpot") is not None:
            tpot.append(rec["tpot"])
    return ReplayedRun(reqs, ttft, tpot, report.get("config", {}))
