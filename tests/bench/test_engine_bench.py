"""pdserve.bench.engine's agreement measure."""

from __future__ import annotations

from pdserve.bench.engine import _agreement


def test_agreement_counts_tokens_before_the_first_difference() -> None:
    assert _agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    # 2 of 4 tokens agree before the texts part, 0 of 2 in the second request.
    assert _agreement([[1, 2, 9, 9], [5, 6]], [[1, 2, 3, 4], [7, 6]]) == 2 / 6
    assert _agreement([[1, 2]], [[1, 2, 3]]) == 2 / 3  # one stopped early
    assert _agreement([], []) == 1.0
