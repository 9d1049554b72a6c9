"""Where a local cluster's CPU time went during a benchmark run, from ``/proc`` (Linux only).

A replica whose engine computes on the CPUs it shares with the serving processes (the Ray
proxy, the ingress, the decode replica's own threads, Ray's daemons) gets only what they
leave of those CPUs; a niced one (``cpu.nice``) gets exactly that. ``bench.sim_validate measure``
takes a ``CpuSnapshot`` before and after each run (and over an idle spell) and writes the
difference, so the simulation can be told how much of the shared CPUs the serving path
used per request: a measured cost, like the engine's step profile, not a fit to latencies.

Threads are grouped by the CPUs they may run on and by whether they are niced (nice >= 10:
a niced prefill replica, the colocated decode engine's helper threads). Reads only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

NICED = 10  # threads at this niceness or more yield their CPU to the serving path


def _cpus(text: str) -> tuple[int, ...]:
    """'0-2,5' -> (0, 1, 2, 5)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def group_key(cpus: tuple[int, ...], niced: bool) -> str:
    return f"cpus={','.join(map(str, cpus))};{'niced' if niced else 'nice0'}"


@dataclass(frozen=True)
class CpuSnapshot:
    """Per thread group, CPU seconds used so far; per CPU, busy seconds so far."""

    at: float
    groups: dict[str, float] = field(default_factory=dict)
    busy: dict[int, float] = field(default_factory=dict)

    @classmethod
    def take(cls, proc: Path = Path("/proc")) -> CpuSnapshot:
        tick = os.sysconf("SC_CLK_TCK")
        groups: dict[str, float] = {}
        for pid in proc.iterdir():
            if not pid.name.isdigit():
                continue
            try:
                tasks = list((pid / "task").iterdir())
            except OSError:
                continue  # the process ended meanwhile
            for task in tasks:
                try:
                    stat = (task / "stat").read_text()
                    status = (task / "status").read_text()
                except OSError:
                    continue
                fields = stat[stat.rindex(")") + 2 :].split()
                used = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
                if used == 0:
                    continue
                allowed = next(
                    line.split(":", 1)[1]
                    for line in status.splitlines()
                    if line.startswith("Cpus_allowed_list:")
                )
                key = group_key(_cpus(allowed), int(fields[16]) >= NICED)
                groups[key] = groups.get(key, 0.0) + used
        busy: dict[int, float] = {}
        for line in (proc / "stat").read_text().splitlines():
            name, *values = line.split()
            if name.startswith("cpu") and name != "cpu":
                v = [int(x) for x in values]
                # user nice system idle iowait irq softirq steal: busy = all but idle, iowait
                busy[int(name[3:])] = (sum(v[:8]) - v[3] - v[4]) / tick
        return cls(time.monotonic(), groups, busy)

    def since(self, earlier: CpuSnapshot) -> dict:
        """What was used between ``earlier`` and this snapshot (JSON-ready). A group that
        lost threads meanwhile can come out negative; it is clipped to 0."""
        return {
            "wall_s": self.at - earlier.at,
            "groups_s": {
                k: max(0.0, v - earlier.groups.get(k, 0.0))
                for k, v in sorted(self.groups.items())
                if v - earlier.groups.get(k, 0.0) > 0.005
            },
            "cpu_busy_s": {str(c): self.busy[c] - earlier.busy.get(c, 0.0) for c in self.busy},
        }


def serving_cpu_s(usage: dict, shared_cpus: tuple[int, ...]) -> float:
    """CPU seconds of the threads that may run only on ``shared_cpus`` and are not niced:
    the serving work a niced engine on those CPUs yields to."""
    return sum(
        s
        for key, s in usage["groups_s"].items()
        if key.endswith(";nice0") and set(_cpus(key[5:].split(";")[0])) <= set(shared_cpus)
    )


def engine_cpu_s(usage: dict, shared_cpus: tuple[int, ...]) -> float:
    """CPU seconds of the niced threads that may run only on ``shared_cpus``: an engine
    process that computes on what the serving path leaves (the disaggregated 2-core
    config's prefill replica)."""
    return sum(
        s
        for key, s in usage["groups_s"].items()
        if key.endswith(";niced") and set(_cpus(key[5:].split(";")[0])) <= set(shared_cpus)
    )
