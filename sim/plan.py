"""Capacity planner behind ``pdserve plan``: how many prefill and decode replicas serve a
request rate within both SLOs, with colocated replicas as the baseline.

Each candidate is simulated (``SimCluster``: the live router, policy and estimator) on the
same seeded requests; "meets" means SLO attainment (goodput) >= the target. The search
starts from a roofline lower bound (prefill and decode capacity vs the offered load), then
walks up: colocated replicas one count at a time (then back down by bisection), and for
each disaggregated total the P:D splits around the load's prefill/decode ratio.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from pdserve.sim.cost import RooflineCost, prefill_tokens_per_s, roofline
from pdserve.sim.hardware import GPUS, MODELS, lookup
from pdserve.sim.metrics import SimReport
from pdserve.sim.request import SimRequest
from pdserve.sim.scenario import PREFILL_CHUNK, gpu_app, simulate
from pdserve.sim.workload import (
    TRACES,
    LogNormalLengths,
    TraceShape,
    make_requests,
    poisson_arrivals,
)


@dataclass(frozen=True)
class PlanRequest:
    model: str
    gpu: str
    rate: float
    ttft_ms: float
    tpot_ms: float
    prompt: str = "chat"
    output: str = "chat"
    tp: int = 0  # 0 = the smallest power of two that fits the model
    link: str = "nvlink"
    target: float = 0.9
    num_requests: int = 1200
    seed: int = 0


@dataclass(frozen=True)
class Candidate:
    prefill: int  # 0 = colocated
    decode: int
    gpus: int
    report: SimReport

    @property
    def label(self) -> str:
        return (
            f"colocated x{self.decode}" if self.prefill == 0 else f"{self.prefill}P:{self.decode}D"
        )


@dataclass(frozen=True)
class Plan:
    colocated: Candidate | None
    disaggregated: Candidate | None
    tried: list[Candidate]
    seconds: float
    tp: int


def parse_lengths(spec: str, which: str) -> LogNormalLengths:
    """A trace name (its prompt or output lengths), N, fixed:N, or lognormal:MEDIAN:SIGMA."""
    if spec in TRACES:
        return getattr(TRACES[spec], which)
    parts = spec.split(":")
    try:
        if len(parts) == 1 or (parts[0] == "fixed" and len(parts) == 2):
            n = int(parts[-1])
            dist = LogNormalLengths(n, 0.0, n, n)
        elif parts[0] == "lognormal" and len(parts) == 3:
            med, sigma = float(parts[1]), float(parts[2])
            dist = LogNormalLengths(med, sigma, 1, int(med * 20))
        else:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"bad --{which} {spec!r}: a trace ({', '.join(sorted(TRACES))}), N, fixed:N or "
            "lognormal:MEDIAN:SIGMA"
        ) from None
    if dist.median < 1:
        raise ValueError(f"bad --{which} {spec!r}: lengths must be >= 1")
    return dist


def _requests(req: PlanRequest) -> list[SimRequest]:
    rng = np.random.default_rng(req.seed)
    times = poisson_arrivals(rng, req.rate, req.num_requests)
    shape = TraceShape(
        "plan", parse_lengths(req.prompt, "prompt"), parse_lengths(req.output, "output")
    )
    return make_requests(shape, times - times[0], rng)


def smallest_tp(model: str, gpu: str) -> int:
    lookup(MODELS, model, "model")  # ValueError naming an unknown one, before any fit test
    lookup(GPUS, gpu, "gpu")
    for tp in (1, 2, 4, 8):
        try:
            cost = roofline(model, gpu, tp=tp)
        except ValueError:
            continue
        if cost.kv_capacity_tokens >= 32 * 4096:  # room for a useful batch
            return tp
    raise ValueError(f"{model} does not fit on 8 x {gpu} with room for a KV cache")


def plan(req: PlanRequest) -> Plan:
    if req.rate <= 0:
        raise ValueError(f"rate must be > 0, got {req.rate}")
    began = time.perf_counter()
    tp = req.tp or smallest_tp(req.model, req.gpu)
    cost = roofline(req.model, req.gpu, tp=tp, link=req.link)
    base = _requests(req)
    cache: dict[tuple[int, int], Candidate] = {}

    def run(p: int, d: int) -> Candidate:
        if (p, d) not in cache:
            reqs = [SimRequest(r.rid, r.arrival, r.prompt_tokens, r.output_tokens) for r in base]
            app = gpu_app(p, d, ttft_ms=req.ttft_ms, tpot_ms=req.tpot_ms, cost=cost)
            report, _ = simulate(app, reqs, cost)
            cache[(p, d)] = Candidate(p, d, (p + d) * tp, report)
        return cache[(p, d)]

    def meets(c: Candidate) -> bool:
        return c.report.goodput >= req.target

    p_min, d_min = _lower_bounds(req, base, cost)
    colocated = _search_colocated(run, meets, max(1, math.ceil(p_min + d_min)))
    disagg = _search_disaggregated(run, meets, p_min, d_min)
    tried = sorted(cache.values(), key=lambda c: (c.gpus, c.prefill))
    return Plan(colocated, disagg, tried, time.perf_counter() - began, tp)


def _lower_bounds(
    req: PlanRequest, base: list[SimRequest], cost: RooflineCost
) -> tuple[float, float]:
    """Replicas that the offered load needs at 100% busy: prefill tokens at the prefill
    rate, and decode tokens at the rate of a full batch whose step stays within the TPOT."""
    mean_prompt = float(np.mean([r.prompt_tokens for r in base]))
    mean_out = float(np.mean([r.output_tokens for r in base]))
    p_rate = prefill_tokens_per_s(cost, int(mean_prompt), PREFILL_CHUNK)
    ctx = int(mean_prompt + mean_out / 2)
    batch = 1
    while batch < 256 and cost.step_s(2 * batch, 0, 2 * batch, 2 * batch * ctx) < req.tpot_ms / 1e3:
        batch *= 2
    d_rate = batch / cost.step_s(batch, 0, batch, batch * ctx)
    return req.rate * mean_prompt / p_rate, req.rate * mean_out / d_rate


def _search_colocated(run, meets, start: int) -> Candidate | None:
    hi = start
    while not meets(run(0, hi)):
        if hi >= 4 * start + 64:
            return None
        hi = max(hi + 1, int(hi * 1.5))
    lo = 0  # fails (or nothing)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mid >= 1 and meets(run(0, mid)):
            hi = mid
        else:
            lo = mid
    return run(0, hi)


def _best_split(run, meets, total: int, p_share: float) -> Candidate | None:
    guess = min(max(1, round(total * p_share)), total - 1)
    splits = sorted({min(max(1, guess + k), total - 1) for k in (-1, 0, 1, 2)})
    ok = [c for c in (run(p, total - p) for p in splits) if meets(c)]
    return max(ok, key=lambda c: c.report.goodput) if ok else None


def _search_disaggregated(run, meets, p_min: float, d_min: float) -> Candidate | None:
    share = p_min / max(p_min + d_min, 1e-9)
    start = max(2, math.ceil(p_min) + math.ceil(d_min))
    total = start
    found = _best_split(run, meets, total, share)
    while found is None:
        if total >= 4 * start + 64:
            return None
        total = max(total + 1, int(total * 1.5))
        found = _best_split(run, meets, total, share)
    lo = start - 1
    while total - lo > 1:  # the smallest total that still meets (bisection)
        mid = (lo + total) // 2
        if mid < 2:
            lo = mid
            continue
        c = _best_split(run, meets, mid, share)
        if c is not None:
            total, found = mid, c
        else:
            lo = mid
    return found


def format_plan(req: PlanRequest, result: Plan) -> str:
    lines = [
        f"{req.model} on {req.gpu.upper()} (tp={result.tp}, KV over {req.link}), "
        f"{req.rate:g} req/s, "
        f"SLO TTFT {req.ttft_ms:g} ms / TPOT {req.tpot_ms:g} ms, target attainment "
        f"{req.target:.0%}, prompt {req.prompt}, output {req.output}",
        f"{'candidate':<16}{'GPUs':>6}{'goodput':>9}{'TTFT p90':>10}{'TPOT p90':>10}"
        f"{'GPU-s/1k':>10}",
    ]
    for c in result.tried:
        r = c.report
        ttft = f"{r.ttft.p90 * 1e3:.0f}ms" if r.ttft else "-"
        tpot = f"{r.tpot.p90 * 1e3:.1f}ms" if r.tpot else "-"
        lines.append(
            f"{c.label:<16}{c.gpus:>6}{r.goodput:>9.1%}{ttft:>10}{tpot:>10}"
            f"{r.gpu_seconds_per_1k:>10.0f}"
        )
    for name, best in (("disaggregated", result.disaggregated), ("colocated", result.colocated)):
        if best is None:
            lines.append(f"recommend {name}: none found within the search bound")
        else:
            lines.append(
                f"recommend {name}: {best.label} = {best.gpus} GPUs, predicted attainment "
                f"{best.report.goodput:.1%} (TTFT {best.report.ttft_attainment:.1%}, "
                f"TPOT {best.report.tpot_attainment:.1%})"
            )
    lines.append(f"planned in {result.seconds:.1f} s ({len(result.tried)} simulations)")
    return "\n".join(lines)
