"""The step-input staging buffers: packed vectors come back intact, the buffer is reused
and grows, and results never alias the reused host buffer (pinned only on CUDA, which
gpu_verify's engine step covers)."""

from __future__ import annotations

import torch

from pdserve.engine.staging import StepStaging


def test_vectors_round_trip_and_the_buffer_is_reused() -> None:
    staging = StepStaging(torch.device("cpu"))
    first = staging.to_device([[1, 2, 3], [], [7]], torch.int64)
    assert [t.tolist() for t in first] == [[1, 2, 3], [], [7]]
    assert all(t.dtype == torch.int64 for t in first)
    buffer = staging._buffers[torch.int64].host
    second = staging.to_device([[9, 9], [4]], torch.int64)
    assert staging._buffers[torch.int64].host is buffer  # reused, not reallocated
    assert [t.tolist() for t in second] == [[9, 9], [4]]
    assert [t.tolist() for t in first] == [[1, 2, 3], [], [7]]  # no aliasing of the buffer
    big = staging.to_device([list(range(1000))], torch.int32)
    assert big[0].dtype == torch.int32 and big[0].tolist() == list(range(1000))
