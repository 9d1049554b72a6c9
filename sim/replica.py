"""What the simulated cluster is made of besides its engines: a replica as the routers see it
(``SimReplica``: its published ``ReplicaStats``, its engine, its books), a remote prefill in
flight between two replicas (``RemoteInFlight``), the admission hook (``Admission``, asked
with an ``AdmissionQuery`` after the live policy placed a request) and the live admission
behind it (``LiveAdmission``: the decode server's own ``DecodeAdmission``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.deployments.admission.decode import (
    AdmissionRequest,
    DecodeAdmission,
    ReplicaSignals,
)
from pdserve.deployments.admission.rules import AdmissionDecision
from pdserve.deployments.config import AppConfig, PoolRole
from pdserve.deployments.load import Ema, RateMeter
from pdserve.deployments.messages import ReplicaStats
from pdserve.deployments.policy import Decision, RemotePrefillEstimator
from pdserve.deployments.routers import InflightLoad
from pdserve.engine.stats import EngineStats
from pdserve.sim.engine import SimEngine
from pdserve.sim.events import Event
from pdserve.sim.prefix import SimPrefixCache
from pdserve.sim.request import SimRequest
from pdserve.sim.seq import Seq


@dataclass(frozen=True)
class AdmissionQuery:
    """What an admission function sees of a request and the decode replica it reached."""

    request: SimRequest
    now: float
    replica_id: str
    decision: Decision  # where the live policy would prefill it
    engine: EngineStats  # the replica's engine, now
    ongoing: int  # requests the replica holds (Serve's ongoing count, this one included)
    step_s: float  # the replica's measured time per output token (EMA; 0 = none yet)
    mean_output_tokens: float  # of the requests it finished (EMA; 0 = none yet)
    remote: RemotePrefillEstimator | None  # its estimate of the prefill pool
    max_num_seqs: int
    default_prefill_tokens_per_s: float


class Admission(Protocol):
    """Admission control: ``admit`` is asked once per request after the policy decided;
    the hooks tell it what became of the requests it admitted."""

    def admit(self, q: AdmissionQuery) -> bool: ...

    def taken_in(self, request: SimRequest) -> None:
        """A local engine took an admitted request in (its queued count includes it)."""

    def first_token(self, request: SimRequest, now: float) -> None: ...

    def finished(self, request: SimRequest) -> None: ...


class LiveAdmission:
    """``Admission`` by the live ``DecodeAdmission``, one per decode replica as each
    ``DecodeServer`` keeps its own, fed the same signals from the simulated replica.
    Simulated prompts share no prefix and are all interactive."""

    def __init__(self, app: AppConfig) -> None:
        self.app = app
        self.replicas: dict[str, DecodeAdmission] = {}
        self._where: dict[int, str] = {}  # admitted request -> its replica
        self.predictions: list[tuple[float, float]] = []  # (predicted, actual) TTFT
        self.last_verdict: AdmissionDecision | None = None

    def of(self, replica_id: str) -> DecodeAdmission:
        if replica_id not in self.replicas:
            self.replicas[replica_id] = DecodeAdmission.from_config(self.app)
        return self.replicas[replica_id]

    def admit(self, q: AdmissionQuery) -> bool:
        req = q.request
        verdict = self.of(q.replica_id).admit(
            AdmissionRequest(
                request_id=str(req.rid),
                priority="interactive",
                prompt_tokens=req.prompt_tokens,
                cached_tokens=0,
                max_tokens=req.output_tokens,
                arrival_time=req.arrival,
                location=q.decision.location,
            ),
            ReplicaSignals(
                engine=q.engine,
                remote=q.remote,
                step_s=q.step_s,
                mean_output_tokens=q.mean_output_tokens,
            ),
            q.now,
        )
        self.last_verdict = verdict
        if verdict.action != "admit":
            return False
        self._where[req.rid] = q.replica_id
        return True

    def taken_in(self, request: SimRequest) -> None:
        replica_id = self._where.get(request.rid)
        if replica_id is not None:
            self.replicas[replica_id].taken_in(str(request.rid))

    def first_token(self, request: SimRequest, now: float) -> None:
        replica_id = self._where.get(request.rid)
        if replica_id is None:
            return
        score = self.replicas[replica_id].first_token(str(request.rid), now)
        if score is not None:
            self.predictions.append((score.predicted_s, score.actual_s))

    def finished(self, request: SimRequest) -> None:
        replica_id = self._where.pop(request.rid, None)
        if replica_id is not None:
            self.replicas[replica_id].finished(str(request.rid))


class SimReplica:
    """One replica as the routers see it (``replica_id``, its published ``ReplicaStats``)
    and its engine."""

    def __init__(
        self, replica_id: str, role: PoolRole, engine: SimEngine, gpus: int, now: float
    ) -> None:
        self.replica_id = replica_id
        self.role = role
        self.engine = engine
        self.gpus = gpus
        self.stats: ReplicaStats | None = None  # the last published report
        self.cache: SimPrefixCache | None = None  # its engine's prefix cache, when it has one
        self.started_at = now
        self.ready = False
        self.draining = False
        self.stopped_at: float | None = None
        self.ongoing = 0
        self.itl = Ema()
        self.outputs = Ema()  # output tokens of the requests it finished
        # Decode replicas: their router to the prefill pool and their remote estimator.
        self.prefill_books = InflightLoad()
        self.estimate: RemotePrefillEstimator | None = None
        self.arrivals: RateMeter | None = None
        # Decode replicas: remote prefills refused for lack of KV room (for the autoscaler).
        self.kv_refused: RateMeter | None = None

    @property
    def routing_stats(self) -> dict[str, Any]:
        """What Serve hands a router (``ReplicaView``)."""
        return self.stats.model_dump() if self.stats is not None else {}


@dataclass
class RemoteInFlight:
    """A request's prompt being prefilled on ``prefill`` for ``decode``: both engines' views
    of it, when it started, the tokens its decode replica had in flight ahead of it, and the
    fall-back deadline."""

    decode: SimReplica
    prefill: SimReplica
    seq_d: Seq
    seq_p: Seq
    began: float
    ahead: int
    deadline: Event
