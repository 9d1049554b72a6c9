"""``pdserve plan``: the recommendation meets the target and is the smallest that does."""

from __future__ import annotations

import pytest

from pdserve.cluster.cli import main
from pdserve.sim.plan import PlanRequest, parse_lengths, plan


def test_plan_recommends_the_fewest_gpus_that_meet_the_target() -> None:
    req = PlanRequest(
        "llama-3-8b", "h100", rate=20, ttft_ms=500, tpot_ms=50, prompt="summarisation",
        output="chat", num_requests=1200,
    )  # fmt: skip
    result = plan(req)
    for best in (result.colocated, result.disaggregated):
        assert best is not None and best.report.goodput >= req.target
        same_kind = [c for c in result.tried if (c.prefill == 0) == (best.prefill == 0)]
        # Every smaller cluster it simulated missed (it starts at a capacity lower bound).
        assert all(c.report.goodput < req.target for c in same_kind if c.gpus < best.gpus)
    assert result.colocated is not None and result.disaggregated is not None
    # Colocated prefill chunks stall decodes and queue prompts: it needs more GPUs here.
    assert result.colocated.gpus > result.disaggregated.gpus


def test_cli_plan_prints_both_recommendations(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "h100", "--rate", "5", "--ttft-ms", "500",
            "--tpot-ms", "50", "--requests", "200"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "recommend disaggregated:" in out and "recommend colocated:" in out


def test_bad_inputs_name_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "b300", "--rate", "5", "--ttft-ms", "500",
            "--tpot-ms", "50"]  # fmt: skip
    assert main(argv) == 2
    assert "unknown gpu 'b300'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="bad --prompt 'lots'"):
        parse_lengths("lots", "prompt")
    assert parse_lengths("fixed:300", "prompt").median == 300
