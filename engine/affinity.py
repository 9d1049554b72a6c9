"""CPU affinity of an engine's compute threads: CPU lists and binding the current thread.

On a CPU-only node the engine's step thread (and the OpenMP workers torch starts from it)
should own its cores: when the serving threads around it (Ray's workers, the proxy, the
ingress) are scheduled onto the same cores, every step waits behind their short bursts and
an OpenMP barrier waits for its slowest thread. vLLM's CPU backend does the same with
``VLLM_CPU_OMP_THREADS_BIND``.

Linux only (``os.sched_setaffinity``); elsewhere binding is a logged no-op. CPU lists use
the kernel's syntax (``0-3,8``), as in ``taskset -c`` and ``/sys/devices/system/cpu``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Set by the cluster (``pdserve up``, or a pod spec) on a node whose engine CPUs it reserved
# for the engine replicas, so no other process of the node runs there.
ENGINE_CPUS_ENV = "PDSERVE_ENGINE_CPUS"


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)`` (sorted, unique); ValueError naming the text if bad."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU or a range") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Collection[int]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def check_cpus_exist(cpus: Collection[int], what: str) -> None:
    """ValueError when a CPU of ``cpus`` is not one of this machine's."""
    count = os.cpu_count() or 1
    missing = [c for c in cpus if c >= count]
    if missing:
        raise ValueError(
            f"{what}: CPU(s) {format_cpu_list(missing)} do not exist on this machine "
            f"(it has CPUs 0-{count - 1})"
        )


def bind_current_thread(cpus: Collection[int]) -> bool:
    """Restrict the calling thread (only it, and threads it starts later) to ``cpus``.

    Returns whether it was bound; failures (another OS, a cgroup that excludes the CPUs)
    are logged, never raised: an unbound engine is slower, not wrong.
    """
    if not cpus:
        return False
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("CPU binding is not supported on this OS; engine threads stay unbound")
        return False
    try:
        os.sched_setaffinity(0, set(cpus))  # 0 = the calling thread on Linux
    except OSError as err:
        logger.warning(
            "could not bind the engine thread to CPUs %s: %s", format_cpu_list(cpus), err
        )
        return False
    logger.info("engine thread bound to CPUs %s", format_cpu_list(cpus))
    return True


def current_thread_cpus() -> tuple[int, ...]:
    """The CPUs the calling thread may run on (all CPUs where affinity is unsupported)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


# Niceness of helper threads: a serving thread of the shared CPUs that wakes up preempts
# them at once, so they use only the time those CPUs would otherwise idle.
HELPER_NICE = 10


@dataclass
class StepThreads:
    """Intra-op threads per engine step: ``base`` (the bound CPUs' threads) for small
    steps, ``total`` (with the helpers on the shared CPUs) for steps of at least
    ``min_tokens`` tokens, where compute, not memory, sets the step's time."""

    base: int
    total: int
    min_tokens: int

    def apply(self, num_tokens: int) -> int:
        want = self.total if num_tokens >= self.min_tokens else self.base
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        return want
