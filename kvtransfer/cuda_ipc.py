"""CUDA IPC for same-node GPU pools, through CuPy (imported lazily; never on CPU paths).

The decode engine exports its KV pool once (``export_handle``): the IPC handle of the CUDA
allocation that holds the pool plus the pool's byte offset inside it. A prefill engine maps
it (``open_pool``) and copies its blocks straight into the reserved ones on a side stream,
after a CUDA event says the layer is computed, and synchronises that copy before it tells the
decode side over the control channel that the layer landed.

Limits: the pool must come from an ordinary ``cudaMalloc``-backed allocation (torch's caching
allocator without expandable segments, or CuPy); the sender must see the pool's GPU
(``gpu_ids``: by UUID, whatever its index there).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "the cuda_ipc transport needs CuPy: pip install 'pdserve[cuda13]' (CUDA 13) or "
            "'pdserve[cuda12]' (CUDA 12)"
        ) from exc
    return cupy


def _allocation_base(ptr: int) -> int:
    """Start of the cudaMalloc allocation containing ``ptr`` (driver API)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    rc = libcuda.cuMemGetAddressRange_v2(
        ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)
    )
    if rc != 0:
        raise RuntimeError(f"cuMemGetAddressRange failed with CUresult {rc}")
    return int(base.value)


def export_handle(pool: torch.Tensor) -> str:
    """'<hex cudaIpcMemHandle_t>:<byte offset of the pool>' for a contiguous CUDA tensor."""
    if pool.device.type != "cuda" or not pool.is_contiguous():
        raise ValueError("kv_cache: CUDA IPC export needs a contiguous CUDA tensor")
    cp = _cupy()
    with cp.cuda.Device(pool.device.index or 0):
        torch.cuda.synchronize(pool.device)
        base = _allocation_base(pool.data_ptr())
        handle = cp.cuda.runtime.ipcGetMemHandle(base)
    return f"{bytes(handle).hex()}:{pool.data_ptr() - base}"


class MappedPool:
    """A peer's pool mapped into this process; ``tensor`` aliases the peer's memory."""

    def __init__(self, handle: str, shape: tuple[int, ...], dtype: torch.dtype, device: int):
        cp = _cupy()
        hex_handle, _, offset = handle.partition(":")
        self._cp = cp
        self._device = device
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with cp.cuda.Device(device):
            self._base = cp.cuda.runtime.ipcOpenMemHandle(
                bytes.fromhex(hex_handle), cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
            )
            mem = cp.cuda.UnownedMemory(self._base + int(offset), nbytes, self, device)
            arr = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        self.tensor = torch.from_dlpack(arr).view(dtype).view(shape)
        self.copy_stream = torch.cuda.Stream(device=device)

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]
        with self._cp.cuda.Device(self._device):
            self._cp.cuda.runtime.ipcCloseMemHandle(self._base)


def open_pool(handle: str, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> MappedPool:
    """Map a peer's pool on local device ``device`` (the peer's GPU as this process
    numbers it; see ``gpu_ids``)."""
    return MappedPool(handle, tuple(shape), dtype, device)
