"""The ingress's count of requests turned away for lack of decode capacity, reported to the
decode pool at most once a period (the autoscaling policy sizes decode by that demand)."""

from __future__ import annotations

from pdserve.deployments.ingress import TurnedAway


def test_capacity_sheds_are_reported_in_batches_at_most_once_a_period() -> None:
    counts = TurnedAway(period_s=1.0)
    assert counts.take(0.0) == 0  # nothing pending: no call
    counts.add()
    counts.add()
    assert counts.take(10.0) == 2  # the first report goes at once
    counts.add()
    assert counts.take(10.5) == 0  # within the period: kept for the next report
    counts.add(3)
    assert counts.take(11.0) == 4
    assert counts.pending == 0 and counts.take(20.0) == 0
