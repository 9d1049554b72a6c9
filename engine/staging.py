"""Host-to-device staging of a step's index tensors: one copy per dtype per step.

A step's batch is a handful of small integer vectors (token ids, positions, cache slots,
sequence offsets and lengths, block tables). Copying each from pageable memory costs a
synchronous transfer apiece; vLLM and SGLang instead fill persistent pinned buffers and
issue one asynchronous copy. ``StepStaging`` does that: the vectors of one dtype are packed
into a reused host buffer (pinned on CUDA), copied once with ``non_blocking=True`` and
handed back as views of the device copy. Before a buffer is refilled the previous copy out
of it must have finished; an event recorded after each copy is waited on (it has always
finished already when the step's sampled tokens came back to the host).
"""

from __future__ import annotations

import itertools

import torch


class _Buffer:
    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = torch.empty(0, dtype=dtype)
        self.copied: torch.cuda.Event | None = None

    def stage(self, vectors: list[list[int]]) -> list[torch.Tensor]:
        sizes = [len(v) for v in vectors]
        total = sum(sizes)
        if self.copied is not None:
            self.copied.synchronize()  # the last copy out of ``host`` is done
        if self.host.numel() < total:
            size = max(total, 2 * self.host.numel(), 256)
            self.host = torch.empty(size, dtype=self.dtype, pin_memory=self.pinned)
        host = self.host[:total]
        host.copy_(torch.tensor(list(itertools.chain.from_iterable(vectors)), dtype=self.dtype))
        if self.device.type == "cpu":
            # No transfer: the views must not alias the reused buffer.
            return list(host.clone().split(sizes))
        dev = host.to(self.device, non_blocking=True)
        if self.pinned:
            self.copied = torch.cuda.Event()
            self.copied.record()
        return list(dev.split(sizes))


class StepStaging:
    """Reused staging buffers of one model runner (int64 and int32 index vectors)."""

    def __init__(self, device: torch.device) -> None:
        self._buffers = {
            torch.int64: _Buffer(torch.int64, device),
            torch.int32: _Buffer(torch.int32, device),
        }

    def to_device(self, vectors: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
        """``vectors`` as 1-D tensors of ``dtype`` on the device, in one copy."""
        return self._buffers[dtype].stage(vectors)
