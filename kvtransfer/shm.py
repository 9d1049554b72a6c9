"""Shared-memory KV pools for CPU engines on one node.

``SharedKVAllocator`` is a ``KVCacheAllocator`` (``(shape, dtype, device) -> Tensor``) that
puts the decode engine's pool in a POSIX shared-memory segment with a unique name, so a
prefill engine on the same node can map it and write the reserved blocks directly.

Ownership rules: the creator (owner) unlinks the segment when it closes or exits; a small
guardian process unlinks it if the owner is killed. Attachers never unlink. Python's
``multiprocessing.shared_memory`` registers even *attached* segments with its resource
tracker on 3.11 (which would unlink the owner's segment when an attacher exits), so this
module maps segments with ``_posixshmem`` + ``mmap`` directly and never involves the tracker.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import secrets
import select
import subprocess
import sys
import threading
from pathlib import Path

import torch

try:  # CPython's POSIX shm wrapper (what multiprocessing.shared_memory uses).
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX platforms
    _posixshmem = None

SEGMENT_PREFIX = "pdserve-kv-"

# The guardian holds the read end of a pipe whose write end only the owner holds; EOF means
# the owner is gone (closed, exited or killed), and the guardian unlinks the segment. It also
# unlinks on SIGTERM/SIGINT/SIGHUP (process supervisors such as Ray's raylet terminate the
# children of a dead worker). If it is SIGKILLed too, ``sweep_stale_segments`` (run by every
# new owner) removes segments whose owner process no longer exists.
_GUARDIAN_CODE = (
    "import os, signal, sys, _posixshmem\n"
    "def unlink(*_):\n"
    "    try:\n"
    "        _posixshmem.shm_unlink(sys.argv[1])\n"
    "    except FileNotFoundError:\n"
    "        pass\n"
    "    os._exit(0)\n"
    "for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
    "    signal.signal(sig, unlink)\n"
    "sys.stdout.write('ready\\n')\n"
    "sys.stdout.close()\n"
    "sys.stdin.buffer.read()\n"
    "unlink()\n"
)


def _process_start(pid: int) -> str | None:
    """Start time of process ``pid`` (clock ticks since boot), None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22, counted after the parenthesised command name (which may contain spaces).
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(name: str, prefix: str) -> bool:
    """Whether the process that created segment ``name`` still runs (unknown: assume yes)."""
    parts = name[len(prefix) :].split("-")
    if not parts or not parts[0].isdigit():
        return True
    start = _process_start(int(parts[0]))
    if start is None:
        return False
    # Names carry the owner's start time so a recycled pid is not mistaken for the owner.
    return len(parts) < 3 or parts[1] == start


def sweep_stale_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Unlink pdserve KV segments whose owner process is gone; returns their names.

    Safe while others still map them: unlinking only removes the name."""
    removed = []
    for name in list_segments(prefix):
        if not _owner_alive(name, prefix):
            with contextlib.suppress(FileNotFoundError):
                _posixshmem.shm_unlink("/" + name)
                removed.append(name)
    return removed


def _require_posix() -> None:
    if _posixshmem is None:
        raise RuntimeError("shared-memory transport needs POSIX shared memory")


class ShmSegment:
    """A mapped POSIX shared-memory segment; ``owner`` segments unlink on close/exit."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        _require_posix()
        if size <= 0:
            raise ValueError(f"size: must be positive, got {size}")
        self.name = name
        self.size = size
        self.owner = create
        self._guardian: subprocess.Popen[bytes] | None = None
        self._closed = False
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(
                    f"shm segment {name!r}: {os.fstat(fd).st_size} bytes, expected >= {size}"
                )
            # Fault the whole mapping in now (the owner commits the pool as torch.zeros would;
            # an attacher fills its page tables once) instead of on the first writes.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mmap = mmap.mmap(fd, size, flags=flags)
        except BaseException:
            os.close(fd)
            if create:
                _posixshmem.shm_unlink("/" + name)
            raise
        os.close(fd)
        if create:
            self._guardian = subprocess.Popen(
                [sys.executable, "-c", _GUARDIAN_CODE, "/" + name],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # survive a signal sent to the owner's group
            )
            atexit.register(self.close)
            self._await_guardian()

    def _await_guardian(self, timeout: float = 30.0) -> None:
        """Return once the guardian has its signal handlers installed."""
        assert self._guardian is not None and self._guardian.stdout is not None
        out = self._guardian.stdout
        ready, _, _ = select.select([out], [], [], timeout)
        line = out.readline() if ready else b""
        out.close()
        if line.strip() != b"ready":
            self.close()
            raise RuntimeError(f"shm guardian for {self.name!r} did not start")

    @classmethod
    def create(cls, size: int, prefix: str = SEGMENT_PREFIX) -> ShmSegment:
        _require_posix()
        sweep_stale_segments(prefix)
        pid = os.getpid()
        name = f"{prefix}{pid}-{_process_start(pid) or 0}-{secrets.token_hex(6)}"
        return cls(name, size, create=True)

    @classmethod
    def attach(cls, name: str, size: int) -> ShmSegment:
        if not name.startswith(SEGMENT_PREFIX):
            raise ValueError(f"shm_name: {name!r} is not a pdserve KV segment")
        return cls(name, size, create=False)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor view of the segment (keeps the mapping alive while it lives)."""
        flat = torch.frombuffer(self.mmap, dtype=torch.uint8)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return flat[:nbytes].view(dtype).view(shape)

    def close(self) -> None:
        """Unlink (owner only) and stop the guardian. The mapping itself stays valid until
        every tensor view is gone; the memory is freed by the OS after that."""
        if self._closed:
            return
        self._closed = True
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                _posixshmem.shm_unlink("/" + self.name)
            if self._guardian is not None:
                assert self._guardian.stdin is not None
                self._guardian.stdin.close()
                try:
                    self._guardian.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._guardian.kill()
            atexit.unregister(self.close)


class SharedKVAllocator:
    """KV cache allocator placing the pool in a fresh shared segment (CPU only).

    Pass an instance as the engine's ``kv_cache_allocator`` and the same instance (or its
    ``segment_for``) to the ``KVReceiver`` so it can advertise the segment.
    """

    def __init__(self) -> None:
        self._segments: dict[int, ShmSegment] = {}
        self._lock = threading.Lock()

    def __call__(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            raise ValueError(f"device: shared-memory KV pools are CPU only, got {device}")
        numel = 1
        for s in shape:
            numel *= s
        size = numel * torch.empty((), dtype=dtype).element_size()
        seg = ShmSegment.create(size)
        tensor = seg.tensor(tuple(shape), dtype)  # a fresh segment is zero-filled
        with self._lock:
            self._segments[tensor.data_ptr()] = seg
        return tensor

    def segment_for(self, tensor: torch.Tensor) -> ShmSegment | None:
        with self._lock:
            return self._segments.get(tensor.data_ptr())

    def close(self) -> None:
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        for seg in segments:
            seg.close()


def list_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Names of pdserve KV segments currently in /dev/shm (Linux)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:  # pragma: no cover - no /dev/shm
        return []
