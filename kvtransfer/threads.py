"""Keep kvtransfer's I/O threads' tensor copies on the calling thread.

ATen runs a large CPU copy as an OpenMP parallel region on a team of ``get_num_threads()``
threads. An I/O thread that opens its own team while the engine's model thread runs another
oversubscribes the cores: the copy then waits for its slowest team member to be scheduled,
which on a busy 2-core host turned a 0.2 ms copy of 2 MiB into a 10 ms median with 100+ ms
tails. A block copy is bound by memory bandwidth, which one core nearly saturates, so the
I/O threads copy single-threaded. The OpenMP thread count is a per-thread setting (ICV):
this changes only the calling thread, not the engine's.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (GNU libgomp), if any."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def single_threaded_copies() -> bool:
    """Make tensor ops started from the calling thread run on it alone (no OpenMP team).

    Call at the top of an I/O thread. Returns whether it took effect."""
    # ATen initialises each thread's OpenMP thread count lazily, on its first query, from
    # the process-wide setting; trigger that first so it cannot undo ours.
    torch.get_num_threads()
    lib = _libgomp()
    if lib is None:
        return False
    lib.omp_set_num_threads(1)
    if torch.get_num_threads() != 1:  # pragma: no cover - another OpenMP runtime
        log.debug("kvtransfer: could not limit this thread's OpenMP team")
        return False
    return True
