"""What a simulation run reports: latency percentiles, SLO attainment (goodput), cost in
GPU-seconds per 1k requests, and replica counts over time.

Definitions follow ``pdserve.bench.serve`` (TTFT to the first token the client sees, TPOT
``(e2e - ttft) / (output tokens - 1)``, percentiles interpolated as numpy does), so a
simulated run and a measured one compare field for field. Goodput is the fraction of all
requests (shed and failed ones included, as misses) within both SLOs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from pdserve.sim.request import SimRequest


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: list[float]) -> Percentiles | None:
        if not values:
            return None
        arr = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(v) for v in np.percentile(arr, (50, 90, 99)))
        return cls(p50, p90, p99, float(arr.mean()))


@dataclass(frozen=True)
class SimReport:
    num_requests: int
    completed: int
    shed: int
    ttft: Percentiles | None
    tpot: Percentiles | None
    e2e: Percentiles | None
    goodput: float  # fraction of requests within both SLOs
    ttft_attainment: float
    tpot_attainment: float
    throughput_rps: float
    gpu_seconds: float
    gpu_seconds_per_1k: float
    placements: dict[str, int]
    timeline: list[tuple[float, int, int]]  # (time, prefill replicas, decode replicas)

    def to_json(self) -> dict:
        return asdict(self)


def summarize(
    requests: list[SimRequest],
    *,
    slo_ttft_s: float,
    slo_tpot_s: float,
    gpu_seconds: float,
    placements: dict[str, int],
    timeline: list[tuple[float, int, int]] | None = None,
) -> SimReport:
    done = [r for r in requests if r.finished_at is not None]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpot = [r.tpot for r in done if r.tpot is not None]
    e2e = [r.e2e for r in done if r.e2e is not None]
    n = max(len(requests), 1)
    ttft_ok = [r for r in done if r.ttft is not None and r.ttft <= slo_ttft_s]
    tpot_ok = [r for r in done if r.tpot is None or r.tpot <= slo_tpot_s]
    both = [r for r in ttft_ok if r.tpot is None or r.tpot <= slo_tpot_s]
    finished_at = [r.finished_at for r in done if r.finished_at is not None]
    span = max(finished_at) - min(r.arrival for r in requests) if finished_at else 0.0
    return SimReport(
        num_requests=len(requests),
        completed=len(done),
        shed=sum(r.placement == "shed" for r in requests),
        ttft=Percentiles.of(ttft),
        tpot=Percentiles.of(tpot),
        e2e=Percentiles.of(e2e),
        goodput=len(both) / n,
        ttft_attainment=len(ttft_ok) / n,
        tpot_attainment=len(tpot_ok) / n,
        throughput_rps=len(done) / span if span > 0 else 0.0,
        gpu_seconds=gpu_seconds,
        gpu_seconds_per_1k=1000 * gpu_seconds / n,
        placements=dict(placements),
        timeline=list(timeline or []),
    )


def format_report(name: str, rep: SimReport) -> str:
    def ms(p: Percentiles | None, field: str) -> str:
        return "-" if p is None else f"{getattr(p, field) * 1e3:.0f}"

    return (
        f"{name:<22} done {rep.completed}/{rep.num_requests} shed {rep.shed}  "
        f"TTFT p50/p90/p99 {ms(rep.ttft, 'p50')}/{ms(rep.ttft, 'p90')}/{ms(rep.ttft, 'p99')} ms  "
        f"TPOT p50/p90/p99 {ms(rep.tpot, 'p50')}/{ms(rep.tpot, 'p90')}/{ms(rep.tpot, 'p99')} ms  "
        f"goodput {rep.goodput:.1%}  GPU-s/1k {rep.gpu_seconds_per_1k:.0f}"
    )
