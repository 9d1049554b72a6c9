"""Decode replicas that share one CPU (``admission_fakes.ModelReplica`` each): while k of
them are in an engine step, each step runs k times slower than on an idle CPU, as two
colocated decode engines on the 2-core VM do. Arrivals come at set times to set replicas;
a shed request is dropped (an open loop). Deterministic: time is the model's."""

from __future__ import annotations

from dataclasses import dataclass

from tests.deployments.admission_fakes import ModelReplica, PlannedStep


@dataclass
class _Running:
    planned: PlannedStep
    started: float
    work_left: float  # seconds of an idle CPU


class SharedCPU:
    """Replicas on one CPU, processor-shared between the ones in a step."""

    def __init__(self, replicas: list[ModelReplica]) -> None:
        self.replicas = replicas
        self.now = 0.0
        self._running: dict[int, _Running] = {}

    def run(self, arrivals: list[tuple[float, int, str]]) -> None:
        """Deliver ``(time, replica index, request id)`` arrivals in time order and run
        until every replica is idle."""
        pending = sorted(arrivals)
        while pending or any(r.busy for r in self.replicas):
            self._start_steps()
            share = max(1, len(self._running))
            step_end = min(
                (self.now + run.work_left * share for run in self._running.values()),
                default=float("inf"),
            )
            if pending and pending[0][0] <= step_end:
                at, index, rid = pending.pop(0)
                self._advance(at, share)
                self.replicas[index].send(rid)
            else:
                self._advance(step_end, share)
                self._finish_steps()

    def _start_steps(self) -> None:
        for i, replica in enumerate(self.replicas):
            if i not in self._running and replica.busy:
                planned = replica.plan()
                self._running[i] = _Running(planned, self.now, planned.seconds)

    def _advance(self, to: float, share: int) -> None:
        for run in self._running.values():
            run.work_left -= (to - self.now) / share
        self.now = to
        for replica in self.replicas:
            replica.now = to

    def _finish_steps(self) -> None:
        for i in [i for i, run in self._running.items() if run.work_left <= 1e-12]:
            run = self._running.pop(i)
            self.replicas[i].complete(run.planned, self.now - run.started)
