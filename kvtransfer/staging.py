"""Reusable staging buffers for the torch.distributed transport.

A layer message is gathered into (sender) or received into (receiver) a flat byte buffer.
Fresh allocations of tens of MiB cost page faults on every message; a small pool of reused
buffers avoids them and bounds memory: with ``count`` buffers, at most ``count`` layers are
in flight per peer (one being copied while the other is on the wire).
"""

from __future__ import annotations

import math
import queue

import torch


class BufferPool:
    def __init__(self, count: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._free: queue.Queue[torch.Tensor | None] = queue.Queue()
        for _ in range(count):
            self._free.put(None)  # allocated on first use, at the size first needed

    def take(self, nbytes: int, timeout: float) -> torch.Tensor:
        """A flat uint8 buffer of at least ``nbytes``; waits up to ``timeout`` for one."""
        try:
            buf = self._free.get(timeout=max(timeout, 0.001))
        except queue.Empty:
            raise TimeoutError("no staging buffer freed in time") from None
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self._free.put(buf)


def typed_view(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The first bytes of flat ``buf`` seen as a contiguous ``dtype`` tensor of ``shape``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return buf[:nbytes].view(dtype).view(shape)


class Scratch:
    """One growable flat byte buffer, reused by a single thread (never shrinks)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buf
