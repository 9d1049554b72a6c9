"""``DecodeAdmission``: one decode replica's admission control. It builds the queue-ahead
view of a new request from its engine's stats and its own books, decides with the rules of
``rules.py``, and keeps the books (prompt tokens admitted without a first token, requests
admitted and open, the calibration learned from first tokens).

``DecodeServer`` and the simulator (``sim.replica.LiveAdmission``) both run this class: the
simulator's promise is that it runs the live admission code, so nothing here may need Ray,
torch or a clock (callers pass times in).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from pdserve.deployments.admission.rules import (
    AdmissionDecision,
    AdmissionRules,
    Calibration,
    PendingPrefills,
    Priority,
    QueueAhead,
    TTFTPrediction,
    decide,
    predict_ttft,
)

if TYPE_CHECKING:
    from pdserve.deployments.config import AppConfig
    from pdserve.deployments.policy import RemotePrefillEstimator
    from pdserve.engine.stats import EngineStats

PrefillLocation = Literal["local", "remote"]


@dataclass(frozen=True)
class AdmissionRequest:
    """What admission sees of one request."""

    request_id: str
    priority: Priority
    prompt_tokens: int
    cached_tokens: int  # of a local prefill (0 = none, or not looked up)
    max_tokens: int  # its output bound: the slot turnover before any request finished
    arrival_time: float | None  # when the ingress received it (None = unknown: now)
    location: PrefillLocation  # where the disaggregation policy prefills it


@dataclass(frozen=True)
class ReplicaSignals:
    """What the decode replica knows of its load now, besides its own admission books."""

    engine: EngineStats
    remote: RemotePrefillEstimator | None  # its estimate of the prefill pool (None: none)
    step_s: float  # time per output token (EMA; 0 = not measured yet)
    mean_output_tokens: float  # of the requests it finished (EMA; 0 = none yet)


@dataclass(frozen=True)
class FirstTokenScore:
    """An admitted request's predicted against its observed TTFT, both from its arrival."""

    predicted_s: float
    actual_s: float


@dataclass
class _Admitted:
    prediction: TTFTPrediction
    ahead: QueueAhead
    uncached: int
    location: PrefillLocation
    admitted_at: float
    arrival: float
    awaiting_first_token: bool = True


def uncached_tokens(prompt_tokens: int, cached_tokens: int, location: PrefillLocation) -> int:
    """The prompt tokens a prefill computes: a remote prefill computes the whole prompt."""
    if location == "remote":
        return prompt_tokens
    return max(1, prompt_tokens - cached_tokens)


class DecodeAdmission:
    """Admit or shed each request a decode replica receives, from what is queued ahead."""

    def __init__(
        self,
        rules: AdmissionRules,
        max_num_seqs: int,
        default_step_s: float,
        default_prefill_tokens_per_s: float,
        history: int = 4096,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if default_step_s <= 0 or default_prefill_tokens_per_s <= 0:
            raise ValueError("default_step_s and default_prefill_tokens_per_s must be > 0")
        self.rules = rules
        self.max_num_seqs = max_num_seqs
        self.default_step_s = default_step_s
        self.default_prefill_tokens_per_s = default_prefill_tokens_per_s
        self.calibration = Calibration()
        self.pending = PendingPrefills()
        self._admitted: dict[str, _Admitted] = {}
        # The rates of the latest prediction per prefill location (what the next one uses).
        self._latest: dict[PrefillLocation, QueueAhead] = {}
        self.scores: deque[FirstTokenScore] = deque(maxlen=history)

    @classmethod
    def from_config(cls, cfg: AppConfig) -> DecodeAdmission:
        """A decode replica's admission under an application's config."""
        return cls(
            AdmissionRules.from_config(
                cfg.admission, cfg.slo, cfg.admission.max_admitted(cfg.decode.ongoing_limit)
            ),
            max_num_seqs=cfg.decode.engine.max_num_seqs,
            default_step_s=cfg.slo.tpot_ms / 1000.0,
            default_prefill_tokens_per_s=cfg.router.default_prefill_tokens_per_s,
        )

    @property
    def num_open(self) -> int:
        """Requests admitted here and not finished."""
        return self.pending.num_open

    def queue_ahead(self, req: AdmissionRequest, signals: ReplicaSignals, now: float) -> QueueAhead:
        """What is ahead of ``req`` here: the engine's counts, or this replica's own books
        where they are ahead of the engine's (a request just admitted, not yet taken in)."""
        stats, remote = signals.engine, signals.remote
        if req.location == "remote":
            if remote is None:
                raise ValueError("a remote prefill needs the prefill pool's estimate")
            # Its queue drains over the whole prefill pool, its own prompt on one replica.
            queued = remote.as_one_queue(
                max(remote.in_flight_tokens, self.pending.tokens("remote"))
            )
            rate, overhead, measured = remote.tokens_per_s, remote.overhead_s, remote.rate_measured
        else:
            # The engine's count, which falls as chunks are computed, plus what it has not
            # taken in yet (a request admitted since its last snapshot).
            queued = stats.queued_prefill_tokens + self.pending.untaken("local")
            rate = stats.prefill_tokens_per_s or self.default_prefill_tokens_per_s
            overhead, measured = 0.0, stats.prefill_tokens_per_s > 0
        in_engine = stats.num_running + stats.num_waiting + stats.num_waiting_remote_kv
        return QueueAhead(
            waited_s=now - req.arrival_time if req.arrival_time is not None else 0.0,
            num_in_batch=max(in_engine, self.pending.num_open),
            max_num_seqs=self.max_num_seqs,
            step_s=signals.step_s or self.default_step_s,
            mean_output_tokens=signals.mean_output_tokens or req.max_tokens,
            queued_prefill_tokens=queued,
            prefill_tokens_per_s=rate,
            prefill_overhead_s=overhead,
            rate_measured=measured,
        )

    def admit(
        self, req: AdmissionRequest, signals: ReplicaSignals, now: float
    ) -> AdmissionDecision:
        """Predict ``req``'s TTFT and decide; an admitted request enters the books until
        ``finished``."""
        ahead = self.queue_ahead(req, signals, now)
        self._latest[req.location] = ahead
        uncached = uncached_tokens(req.prompt_tokens, req.cached_tokens, req.location)
        prediction = predict_ttft(ahead, uncached, self.calibration.value)
        verdict = decide(prediction, req.priority, self.rules, self.pending.num_open)
        if verdict.action == "admit":
            self.pending.admitted(req.request_id, req.location, uncached)
            arrival = req.arrival_time if req.arrival_time is not None else now
            self._admitted[req.request_id] = _Admitted(
                prediction, ahead, uncached, req.location, now, arrival
            )
        return verdict

    def taken_in(self, request_id: str) -> None:
        """The local engine took an admitted request in: from now its own count of queued
        prompt tokens carries it."""
        self.pending.taken_in(request_id)

    def first_token(self, request_id: str, now: float) -> FirstTokenScore | None:
        """An admitted request's first token: its prompt leaves the books, and the
        prediction is scored and calibrates the next ones (None: not admitted here)."""
        entry = self._admitted.get(request_id)
        if entry is None or not entry.awaiting_first_token:
            return None
        entry.awaiting_first_token = False
        self.pending.first_token(request_id)
        prediction = entry.prediction
        if prediction.ahead_s > 0:
            # Only a prediction with a queue ahead calibrates: a lone request's error is
            # its fixed costs (the step it waited for, its trip through the event loop),
            # which a factor would multiply by the depth of every later queue.
            self.calibration.observe(self._at_latest_rates(entry), now - entry.admitted_at)
        score = FirstTokenScore(prediction.total_s, now - entry.arrival)
        self.scores.append(score)
        return score

    def _at_latest_rates(self, entry: _Admitted) -> float:
        """The uncalibrated remaining time of an admitted request's queue, its prompt tokens
        priced at the prefill rate the next prediction uses. The measured rate follows a
        change of the CPU's share (another engine on the same cores starting or stopping) a
        few steps late; a factor learned against the rate of admission would count the
        change a second time once it has caught up, so it learns only what the rate still
        misses. The time per step stays the admission's: it also grows as the batch fills
        (prefill chunks share the steps), and a queue priced at a fuller batch's step put
        one replica's factor too low while its batch grew."""
        latest = self._latest.get(entry.location, entry.ahead)
        ahead = replace(
            entry.ahead,
            prefill_tokens_per_s=latest.prefill_tokens_per_s,
            prefill_overhead_s=latest.prefill_overhead_s,
        )
        return predict_ttft(ahead, entry.uncached).remaining_s

    def finished(self, request_id: str) -> None:
        """An admitted request ended (finished, failed or cancelled)."""
        if self._admitted.pop(request_id, None) is not None:
            self.pending.finished(request_id)
