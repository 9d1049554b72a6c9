"""CPU lists and what a replica asks of the CPU runtime; imports no torch.

CPU lists use the kernel's syntax (``0-3,8``), as in ``taskset -c`` and
``/sys/devices/system/cpu``. The cluster (``pdserve up``), the config validators and the
CLI read them without loading torch; ``runtime`` applies them. Nothing here changes the
process: it only parses, formats and resolves.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass

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


def current_thread_cpus() -> tuple[int, ...]:
    """The CPUs the calling thread may run on (all CPUs where affinity is unsupported)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def engine_cpus(cpu_bind: str, environ: Mapping[str, str] = os.environ) -> tuple[int, ...]:
    """The CPUs a replica's engine thread binds to under the pool's ``cpu_bind``; () = none.

    'auto' takes the node's reservation (``$PDSERVE_ENGINE_CPUS``), an explicit list is used
    as given; either must name CPUs this machine has (ValueError otherwise).
    """
    if cpu_bind == "none":
        return ()
    if cpu_bind == "auto":
        text = environ.get(ENGINE_CPUS_ENV, "").strip()
        what = f"${ENGINE_CPUS_ENV}={text!r}"
    else:
        text, what = cpu_bind, f"cpu_bind {cpu_bind!r}"
    if not text:
        return ()
    cpus = parse_cpu_list(text)
    check_cpus_exist(cpus, what)
    return cpus


@dataclass(frozen=True)
class RuntimeSettings:
    """What a replica asks of its engine's device runtime: a pool's ``num_cpus`` and its
    ``cpu:`` section, with the node's CPU reservation read once by the replica.

    The default (no pool) leaves torch's thread count to the runtime's own cap and binds
    nothing. On a GPU only ``num_cpus`` is used; the rest is ignored with one log line.
    """

    num_cpus: float | None = None  # torch intra-op threads (at least 1); None = torch's own
    nice: int = 0  # niceness added to every thread of the process; 0 = unchanged
    engine_nice: int = 0  # niceness of the engine's step thread and its OpenMP threads only
    cpu_bind: str = "none"  # 'auto' (the node's reservation), 'none' or a CPU list
    node_engine_cpus: str = ""  # $PDSERVE_ENGINE_CPUS of the node ('' = none reserved)
    helper_threads: int = 0  # OpenMP helpers on the process's other CPUs (bound engines)
    helper_min_tokens: int = 32  # smallest step (tokens) the helpers join

    def __post_init__(self) -> None:
        if self.num_cpus is not None and self.num_cpus <= 0:
            raise ValueError(f"num_cpus must be > 0, got {self.num_cpus}")
        for name in ("nice", "engine_nice"):
            if not 0 <= getattr(self, name) <= 19:
                raise ValueError(f"{name} must lie in [0, 19], got {getattr(self, name)}")
        if self.cpu_bind not in ("auto", "none"):
            parse_cpu_list(self.cpu_bind)  # ValueError naming the list
        if self.helper_threads < 0:
            raise ValueError(f"helper_threads must be >= 0, got {self.helper_threads}")
        if self.helper_min_tokens < 1:
            raise ValueError(f"helper_min_tokens must be >= 1, got {self.helper_min_tokens}")

    def engine_cpus(self) -> tuple[int, ...]:
        """The CPUs the engine thread binds to (ValueError if one does not exist here)."""
        return engine_cpus(self.cpu_bind, {ENGINE_CPUS_ENV: self.node_engine_cpus})


@dataclass(frozen=True)
class RuntimeInfo:
    """Where a started engine computes, for reports: () = unbound / no helpers."""

    engine_cpus: tuple[int, ...] = ()
    helper_cpus: tuple[int, ...] = ()
