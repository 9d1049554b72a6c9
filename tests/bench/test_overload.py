"""bench/overload.py's bookkeeping (the run itself needs a real cluster: run the module)."""

from __future__ import annotations

from pdserve.bench.overload import Outcome, client_lag_by_phase, summarize


def test_client_lag_is_reported_per_phase() -> None:
    phases = [("1x", 1.0, 10.0), ("10x", 10.0, 10.0), ("1x-after", 1.0, 10.0)]
    samples = [(t / 10, 0.001) for t in range(100)] + [(10.0 + t / 10, 0.2) for t in range(100)]
    lag = client_lag_by_phase(samples, phases)
    assert lag["1x"] == {"p99_s": 0.001, "max_s": 0.001}
    assert lag["10x"]["p99_s"] == 0.2
    assert lag["1x-after"] == {"p99_s": None, "max_s": None}  # no sample: nothing claimed


def test_summary_counts_what_the_client_saw() -> None:
    ok = Outcome("10x", "interactive", 1.0, status=200, headers_s=0.5, ttft=0.5, finished=True)
    cut = Outcome("10x", "interactive", 1.1, status=200, headers_s=0.5, ttft=0.6)
    shed = Outcome("10x", "interactive", 1.2, status=429, headers_s=0.05, retry_after="2")
    failed = Outcome("10x", "batch", 1.3, status=503, headers_s=0.01)
    silent = Outcome("10x", "batch", 1.4)
    rows = summarize([ok, cut, shed, failed, silent], slo_s=2.0)
    inter = rows["10x/interactive"]
    assert (inter["sent"], inter["admitted"], inter["shed_429"]) == (3, 2, 1)
    assert inter["lost"] == 1  # admitted but never finished
    assert inter["shed_with_retry_after"] == 1 and inter["reject_p99_s"] == 0.05
    batch = rows["10x/batch"]
    assert (batch["5xx"], batch["lost"]) == (1, 1)  # no answer at all is lost
