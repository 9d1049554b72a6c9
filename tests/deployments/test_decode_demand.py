"""What a decode replica reports to the autoscaling policy about its demand: requests it
admitted, and requests turned away for lack of capacity (its own sheds, and those the
ingress reports), per second over its 10 s window (no Ray: the real tiny engine)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.deployments.autoscaling import ADMITTED_PER_S, TURNED_AWAY_PER_S
from pdserve.deployments.decode_server import DecodeServer
from tests.deployments.in_process import LONG_A, SHORT, behind, collect, config, request


def test_decode_replica_reports_admitted_and_turned_away_demand() -> None:
    cfg = config(
        slo={"ttft_ms": 0.01}, admission={"on_slo_miss": "shed", "batch_on_slo_miss": "queue"}
    )
    decode = DecodeServer(cfg, cfg.model.resolve_path(), prefill=None)
    try:
        before = decode.record_autoscaling_stats()
        assert before[ADMITTED_PER_S] == 0.0 and before[TURNED_AWAY_PER_S] == 0.0
        # A batch request (queues: admitted) measures the prefill rate; then an interactive
        # one predicted over its 10 us objective behind a second batch request is shed.
        asyncio.run(collect(decode, request("batch", SHORT, priority="batch")))
        ahead = request("ahead", SHORT, priority="batch")
        shed = asyncio.run(behind(decode, ahead, request("shed-me", LONG_A)))
        assert shed[0].error is not None and shed[0].error.code == 429
        stats = decode.record_autoscaling_stats()
        assert stats[ADMITTED_PER_S] == pytest.approx(2 / 10)  # 2 requests over 10 s
        assert stats[TURNED_AWAY_PER_S] == pytest.approx(1 / 10)
        # The ingress turned 5 more away at its door on the pool's drain hint.
        decode.report_turned_away(5)
        assert decode.record_autoscaling_stats()[TURNED_AWAY_PER_S] == pytest.approx(6 / 10)
        decode.report_turned_away(0)  # an empty report changes nothing
        assert decode.record_autoscaling_stats()[TURNED_AWAY_PER_S] == pytest.approx(6 / 10)
        with pytest.raises(ValueError, match="requests must be >= 0"):
            decode.report_turned_away(-1)
    finally:
        decode.shutdown()
