"""Issue 18's admission control (``pdserve.deployments.admission``) as a ``SimCluster``
admission: the live ``predict_ttft`` / ``decide`` / ``Calibration`` / ``PendingPrefills``,
one set of books per decode replica, as each ``DecodeServer`` keeps its own.

The ``QueueAhead`` a decode server hands ``predict_ttft`` is assembled inside
``DecodeServer._admit`` (a method, being written, that needs the replica's engine); here it
is assembled from the same signals of the simulated replica; that is the one place to keep
in step with the decode server. The rules are the live ``AdmissionRules.from_config``.
"""

from __future__ import annotations

from typing import Any

from pdserve.deployments.config import AppConfig
from pdserve.sim.cluster import AdmissionQuery
from pdserve.sim.request import SimRequest


def live_admission_available() -> bool:
    try:
        import pdserve.deployments.admission  # noqa: F401
    except ImportError:
        return False
    return True


class LiveAdmission:
    """``Admission`` backed by ``pdserve.deployments.admission`` (ImportError without it)."""

    def __init__(self, app: AppConfig) -> None:
        from pdserve.deployments import admission

        self._a = admission
        self.rules = admission.AdmissionRules.from_config(app.policy, app.slo)
        self._tpot_s = app.slo.tpot_ms / 1000.0
        self._books: dict[str, tuple[Any, Any]] = {}  # replica -> (calibration, pending)
        self._where: dict[int, str] = {}  # admitted request -> its replica
        self._open: dict[int, tuple[str, Any, float]] = {}  # rid -> (replica, prediction, t)
        self.predictions: list[tuple[float, float]] = []  # (predicted, actual) TTFT

    def _of(self, replica_id: str) -> tuple[Any, Any]:
        if replica_id not in self._books:
            self._books[replica_id] = (self._a.Calibration(), self._a.PendingPrefills())
        return self._books[replica_id]

    def admit(self, q: AdmissionQuery) -> bool:
        a, req, stats = self._a, q.request, q.engine
        calibration, pending = self._of(q.replica_id)
        n = req.prompt_tokens
        if q.decision.location == "remote" and q.remote is not None:
            est = q.remote
            # Its queue drains over the whole prefill pool, its own prompt on one replica.
            queued = est.as_one_queue(max(est.in_flight_tokens, pending.tokens("remote")))
            rate, overhead = est.tokens_per_s, est.overhead_s
        else:
            queued = max(stats.queued_prefill_tokens, pending.tokens("local"))
            rate = stats.prefill_tokens_per_s or q.default_prefill_tokens_per_s
            overhead = 0.0
        in_engine = stats.num_running + stats.num_waiting + stats.num_waiting_remote_kv
        ahead = a.QueueAhead(
            waited_s=q.now - req.arrival,
            num_in_batch=max(in_engine, pending.num_open),
            max_num_seqs=q.max_num_seqs,
            step_s=q.step_s or self._tpot_s,
            mean_output_tokens=q.mean_output_tokens or req.output_tokens,
            queued_prefill_tokens=queued,
            prefill_tokens_per_s=rate,
            prefill_overhead_s=overhead,
        )
        prediction = a.predict_ttft(ahead, n, calibration.value)
        verdict = a.decide(prediction, "interactive", self.rules)
        if verdict.action != "admit":
            return False
        pending.admitted(str(req.rid), q.decision.location, n)
        self._where[req.rid] = q.replica_id
        self._open[req.rid] = (q.replica_id, prediction, q.now)
        return True

    def first_token(self, request: SimRequest, now: float) -> None:
        entry = self._open.pop(request.rid, None)
        if entry is None:
            return
        replica_id, prediction, admitted_at = entry
        calibration, pending = self._of(replica_id)
        pending.first_token(str(request.rid))
        calibration.observe(prediction.remaining_s / prediction.calibration, now - admitted_at)
        self.predictions.append((prediction.total_s, now - request.arrival))

    def finished(self, request: SimRequest) -> None:
        replica_id = self._where.pop(request.rid, None)
        if replica_id is not None:
            self._books[replica_id][1].finished(str(request.rid))
