"""pdserve.bench.engine's agreement measure."""

from __future__ import annotations

from pdserve.bench.engine import _agreement


def test_agreement_counts_tokens_before_the_first_difference() -> None:
    assert _agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    # 2 of 4 tokens agree before the texts part, 0 of 2 in the second request.
    assert _agreement([[1, 2, 9, 9], [5, 6]], [[1, 2, 3, 4], [7, 6]]) == 2 / 6
    assert _agreement([[1, 2]], [[1, 2, 3]]) == 2 / 3  # one stopped early
    assert _agreement([], []) == 1.0


def test_timestamps_wait_for_the_gpu(monkeypatch) -> None:
    """Every timestamp of the engine benchmark synchronises CUDA first (when it is in use)."""
    import torch

    from pdserve.bench import engine as bench

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    bench.now()
    assert calls == ["sync"]
    import inspect

    source = inspect.getsource(bench)
    assert source.count("time.perf_counter()") == 1  # only inside now()


def test_half_precision_agreement_is_reported_against_both_references(tmp_path) -> None:
    """In bf16 the benchmark compares both systems with transformers in float32 as well."""
    import json

    from pdserve.bench import engine as bench

    out = tmp_path / "engine.json"
    bench.main(
        ["--size", "tiny", "--dtype", "bfloat16", "--workload", "fixed", "--concurrency", "2"]
        + ["--prompt-len", "16", "--max-tokens", "4", "--out", str(out)]
    )
    agree = json.loads(out.read_text())["workloads"]["fixed"]["greedy_agreement"]["2"]
    assert set(agree) == {"pdserve_vs_transformers", "pdserve_vs_fp32", "transformers_vs_fp32"}
    assert all(0.0 <= v <= 1.0 for v in agree.values())
