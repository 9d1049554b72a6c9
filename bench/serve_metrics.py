"""What ``pdserve.bench.serve`` measures and how it summarises it.

Definitions follow the common load tools (vLLM bench, guidellm): TTFT is the time to the
first chunk with non-empty text; ITL the gaps between such chunks; TPOT
``(e2e - ttft) / (output_tokens - 1)``; output tokens come from the final
``usage.completion_tokens`` (the number of text chunks only when the server sends no usage).
Percentiles interpolate linearly (numpy's default). A failed request counts against SLO
attainment.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds, relative to its send)."""

    index: int
    prompt_tokens: int  # server-reported when available, else the workload's count
    output_tokens: int = 0
    ok: bool = False
    error: str | None = None
    send_time: float = 0.0  # since the start of the run
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    usage_reported: bool = False
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when reported
    text: str = ""  # the streamed output (a multi-turn conversation sends it back)

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> Distribution | None:
        if not values:
            return None
        arr = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(v) for v in np.percentile(arr, PERCENTILES))
        return cls(float(arr.mean()), p50, p90, p99, len(values))


@dataclass(frozen=True)
class Summary:
    """The numbers of one endpoint's run (latencies in seconds)."""

    endpoint: str
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    input_throughput: float
    total_output_tokens: int
    total_prompt_tokens: int
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    slo_ttft_s: float | None
    slo_tpot_s: float | None
    ttft_attainment: float | None
    tpot_attainment: float | None
    slo_attainment: float | None
    errors: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _attainment(records: list[RequestRecord], ok: Any) -> float | None:
    if not records:
        return None
    return sum(1 for r in records if r.ok and ok(r)) / len(records)


def summarize(
    endpoint: str,
    records: list[RequestRecord],
    duration_s: float,
    *,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> Summary:
    """Aggregate one endpoint's records; ``duration_s`` is first send to last completion."""
    done = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "unknown")[:120]
            errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)

    def ttft_ok(r: RequestRecord) -> bool:
        return slo_ttft_s is None or (r.ttft is not None and r.ttft <= slo_ttft_s)

    def tpot_ok(r: RequestRecord) -> bool:
        return slo_tpot_s is None or r.tpot is None or r.tpot <= slo_tpot_s

    return Summary(
        endpoint=endpoint,
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(out_tokens),
        input_throughput=per_s(in_tokens),
        total_output_tokens=out_tokens,
        total_prompt_tokens=in_tokens,
        ttft=Distribution.of([r.ttft for r in done if r.ttft is not None]),
        tpot=Distribution.of([t for r in done if (t := r.tpot) is not None]),
        itl=Distribution.of([gap for r in done for gap in r.itl]),
        e2e=Distribution.of([r.e2e for r in done if r.e2e is not None]),
        slo_ttft_s=slo_ttft_s,
        slo_tpot_s=slo_tpot_s,
        ttft_attainment=_attainment(records, ttft_ok) if slo_ttft_s is not None else None,
        tpot_attainment=_attainment(records, tpot_ok) if slo_tpot_s is not None else None,
        slo_attainment=(
            _attainment(records, lambda r: ttft_ok(r) and tpot_ok(r))
            if slo_ttft_s is not None or slo_tpot_s is not None
            else None
        ),
        errors=errors,
    )
