"""Workloads: deterministic from a seed, shaped as their traces say, bursty when asked, and
``bench.serve --save-requests`` output replayed as it was sent."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.sim.workload import TRACES, gamma_arrivals, generate, replay


def _shape(reqs):
    return [(r.arrival, r.prompt_tokens, r.output_tokens) for r in reqs]


def test_same_seed_same_requests_other_seed_others() -> None:
    assert _shape(generate("chat", 5.0, 50, seed=3)) == _shape(generate("chat", 5.0, 50, seed=3))
    assert _shape(generate("chat", 5.0, 50, seed=3)) != _shape(generate("chat", 5.0, 50, seed=4))


@pytest.mark.parametrize("name", sorted(TRACES))
def test_trace_lengths_follow_their_shape(name: str) -> None:
    reqs = generate(name, 10.0, 4000, seed=0)
    shape = TRACES[name]
    prompts = np.array([r.prompt_tokens for r in reqs])
    outputs = np.array([r.output_tokens for r in reqs])
    assert np.median(prompts) == pytest.approx(shape.prompt.median, rel=0.1)
    assert np.median(outputs) == pytest.approx(shape.output.median, rel=0.15)
    assert prompts.min() >= shape.prompt.lo and prompts.max() <= shape.prompt.hi
    span = reqs[-1].arrival - reqs[0].arrival
    assert len(reqs) / span == pytest.approx(10.0, rel=0.1)


def test_bursty_arrivals_keep_the_rate_and_raise_the_variation() -> None:
    rng = np.random.default_rng(0)
    gaps = np.diff(gamma_arrivals(rng, 4.0, 20000, cv=3.0))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)


def test_replay_of_bench_serve_save_requests(tmp_path: Path) -> None:
    records = [
        {"index": 1, "prompt_tokens": 300, "output_tokens": 32, "ok": True, "error": None,
         "send_time": 0.7, "ttft": 0.4, "e2e": 1.4, "itl": [], "usage_reported": True,
         "tpot": 1.0 / 31},
        {"index": 0, "prompt_tokens": 120, "output_tokens": 0, "ok": False, "error": "boom",
         "send_time": 0.0, "ttft": None, "e2e": None, "itl": [], "usage_reported": False,
         "tpot": None},
    ]  # fmt: skip
    path = tmp_path / "summary.json"
    report = {"config": {"output_len": "fixed:32"}, "requests": {"coloc": records}}
    path.write_text(json.dumps(report))
    run = replay(path)
    assert _shape(run.requests) == [(0.0, 120, 32), (0.7, 300, 32)]
    assert run.measured_ttft == [0.4] and run.measured_tpot == [pytest.approx(1.0 / 31)]
    with pytest.raises(ValueError, match="no endpoint 'other'"):
        replay(path, "other")
