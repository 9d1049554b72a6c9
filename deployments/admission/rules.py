"""Admission rules: predict a request's time to first token from everything queued ahead
of it, and admit it or shed it (HTTP 429 with a Retry-After from the predicted drain time).

The decision runs on the decode replica that received the request, before any work
(``decode.DecodeAdmission``; why there: docs/decisions.md). Every request carries its
arrival time, so the time it already waited in the ingress and Serve's queue is part of
its prediction.

Prediction (seconds from arrival):
    waited (ingress + Serve's queue)
  + slot wait: when the batch is full, until enough running requests finish
    (excess / completion rate, the completion rate being running / (output tokens x step))
  + prefill: the prompt tokens queued ahead of this one (local engine, or the prefill pool
    for a remote prefill) and its own uncached tokens, at the measured rate
  + one engine step for the first token,
the part after ``waited`` scaled by a calibration learned from observed first tokens.

Pure logic: no Ray, no torch, no clock (callers pass times in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pdserve.deployments.config import AdmissionConfig, SLOConfig

Priority = Literal["interactive", "batch"]
Action = Literal["admit", "shed"]
OnMiss = Literal["queue", "shed"]


@dataclass(frozen=True)
class QueueAhead:
    """What is ahead of a new request on one decode replica."""

    waited_s: float  # since the ingress received it (ingress + Serve's queue)
    num_in_batch: int  # requests holding or waiting for a batch slot (engine + just admitted)
    max_num_seqs: int
    step_s: float  # measured decode step time at the current batch; 0 = not measured
    mean_output_tokens: float  # output tokens of a finished request (slot turnover)
    queued_prefill_tokens: int  # prompt tokens waiting to prefill where this one will
    prefill_tokens_per_s: float  # measured rate there (> 0)
    prefill_overhead_s: float = 0.0  # remote prefill: RPC + transfer beyond the compute
    # False while prefill_tokens_per_s is still a configured prior, not a measurement.
    rate_measured: bool = True


@dataclass(frozen=True)
class TTFTPrediction:
    waited_s: float
    slot_wait_s: float
    prefill_s: float
    first_step_s: float
    calibration: float = 1.0
    measured: bool = True  # False: the prefill time rests on a configured prior rate
    # The part of slot_wait_s + prefill_s that is other requests' work (0 = nothing ahead).
    ahead_s: float = 0.0

    @property
    def remaining_s(self) -> float:
        """From now until the first token (what a request arriving now would still wait)."""
        return self.calibration * (self.slot_wait_s + self.prefill_s + self.first_step_s)

    @property
    def total_s(self) -> float:
        return self.waited_s + self.remaining_s


@dataclass(frozen=True)
class AdmissionRules:
    """Per-class thresholds, from ``AdmissionConfig`` and the SLO (see ``config.py``)."""

    ttft_slo_s: float
    interactive_factor: float  # shed when predicted TTFT > factor x SLO
    batch_factor: float  # lower than interactive: batch sheds first
    interactive_on_miss: OnMiss
    batch_on_miss: OnMiss
    interactive_max_wait_s: float  # a request that already waited this long is dropped
    batch_max_wait_s: float  # batch may queue longer
    # Most requests a replica holds admitted; past it a class that sheds is shed whatever the
    # prediction, so that Serve's slots above it stay free for answering 429s at once
    # (0 = no bound).
    max_admitted: int = 0

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0:
            raise ValueError(f"ttft_slo_s must be > 0, got {self.ttft_slo_s}")
        for name in ("interactive_factor", "batch_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_config(
        cls, admission: AdmissionConfig, slo: SLOConfig, max_admitted: int = 0
    ) -> AdmissionRules:
        """The rules of an application's ``admission`` and ``slo`` sections."""
        slo_s = slo.ttft_ms / 1000.0
        return cls(
            ttft_slo_s=slo_s,
            interactive_factor=admission.shed_ttft_factor,
            batch_factor=admission.batch_shed_ttft_factor,
            interactive_on_miss=admission.on_slo_miss,
            batch_on_miss=admission.batch_on_slo_miss,
            interactive_max_wait_s=admission.max_queue_wait_factor * slo_s,
            batch_max_wait_s=admission.batch_max_queue_wait_s,
            max_admitted=max_admitted,
        )

    def threshold_s(self, priority: Priority) -> float:
        factor = self.interactive_factor if priority == "interactive" else self.batch_factor
        return factor * self.ttft_slo_s

    def on_miss(self, priority: Priority) -> OnMiss:
        return self.interactive_on_miss if priority == "interactive" else self.batch_on_miss

    def max_wait_s(self, priority: Priority) -> float:
        return self.interactive_max_wait_s if priority == "interactive" else self.batch_max_wait_s


@dataclass(frozen=True)
class AdmissionDecision:
    action: Action
    # admitted | queued_past_slo | unmeasured | idle_past_slo | ttft_slo | queue_full | deadline
    reason: str
    predicted_ttft_s: float
    retry_after_s: float | None  # set when shed

    @property
    def past_slo(self) -> bool:
        """Admitted although predicted over its class's threshold."""
        return self.action == "admit" and self.reason != "admitted"


def slot_wait_s(q: QueueAhead) -> float:
    """Time until a batch slot frees for the new request (0 while the batch has room)."""
    excess = q.num_in_batch + 1 - q.max_num_seqs
    if excess <= 0:
        return 0.0
    running = min(q.num_in_batch, q.max_num_seqs)
    per_request_s = max(q.mean_output_tokens, 1.0) * q.step_s
    if running <= 0 or per_request_s <= 0:
        return 0.0
    return excess * per_request_s / running


def predict_ttft(q: QueueAhead, uncached_tokens: int, calibration: float = 1.0) -> TTFTPrediction:
    """The request's predicted TTFT, counted from its arrival."""
    if uncached_tokens < 1:
        raise ValueError(f"uncached_tokens must be >= 1, got {uncached_tokens}")
    if q.prefill_tokens_per_s <= 0:
        raise ValueError(f"prefill_tokens_per_s must be > 0, got {q.prefill_tokens_per_s}")
    prefill_s = (
        q.prefill_overhead_s + (q.queued_prefill_tokens + uncached_tokens) / q.prefill_tokens_per_s
    )
    slot_s = slot_wait_s(q)
    return TTFTPrediction(
        waited_s=max(0.0, q.waited_s),
        slot_wait_s=slot_s,
        prefill_s=prefill_s,
        first_step_s=q.step_s,
        calibration=calibration,
        measured=q.rate_measured,
        ahead_s=slot_s + q.queued_prefill_tokens / q.prefill_tokens_per_s,
    )


# A shed's drain time is never shorter than this (a request just over its threshold).
MIN_DRAIN_S = 0.1


def retry_after_s(prediction: TTFTPrediction, threshold_s: float) -> float:
    """Seconds until the queue ahead has drained enough that a request arriving then is
    predicted under ``threshold_s``: exact, since the ingress sheds the class at its door
    for that long (``ShedHint``; rounded up to whole seconds, at least 1, the window could
    leave the engine idle for up to a second after every shed). The HTTP ``Retry-After``
    header rounds it up to whole seconds. Never past the drain of the queue ahead: a request
    whose own work exceeds the threshold is served once nothing is ahead of it."""
    drained_s = prediction.calibration * prediction.ahead_s
    return max(MIN_DRAIN_S, min(prediction.remaining_s - threshold_s, drained_s))


def decide(
    prediction: TTFTPrediction, priority: Priority, rules: AdmissionRules, num_admitted: int = 0
) -> AdmissionDecision:
    """Admit, or shed when the client's wait is already spent, the replica holds
    ``rules.max_admitted`` requests, or the predicted TTFT exceeds the class's threshold
    (the last two only for a class that sheds on a miss)."""
    threshold = rules.threshold_s(priority)
    total = prediction.total_s
    if prediction.waited_s > rules.max_wait_s(priority):
        # Dropped before it prefills: its client has (or should have) given up.
        return AdmissionDecision("shed", "deadline", total, retry_after_s(prediction, threshold))
    sheds = rules.on_miss(priority) == "shed"
    if sheds and rules.max_admitted and num_admitted >= rules.max_admitted:
        return AdmissionDecision(
            "shed", "queue_full", total, retry_after_s(prediction, min(threshold, total))
        )
    if total <= threshold:
        return AdmissionDecision("admit", "admitted", total, None)
    if not sheds:
        return AdmissionDecision("admit", "queued_past_slo", total, None)
    if not prediction.measured:
        # A prediction from the configured prior rate (a cold pool) never sheds: shedding on
        # a guess turned a whole cold burst away, and a shed request never produces the
        # measurement that would correct the guess.
        return AdmissionDecision("admit", "unmeasured", total, None)
    if prediction.ahead_s <= 0:
        # Nothing is queued ahead: its own work is over the threshold, so waiting cannot
        # help and every retry would be shed again. Served, and counted as an SLO miss.
        return AdmissionDecision("admit", "idle_past_slo", total, None)
    return AdmissionDecision("shed", "ttft_slo", total, retry_after_s(prediction, threshold))


class Calibration:
    """Ratio of observed to predicted remaining time to first token (an EMA, clipped), so a
    systematic bias of the cost model (e.g. prefill chunks sharing steps with decodes)
    corrects itself from the first tokens the replica sees."""

    def __init__(self, alpha: float = 0.3, low: float = 0.5, high: float = 4.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0 < low <= 1 <= high:
            raise ValueError(f"need 0 < low <= 1 <= high, got low={low}, high={high}")
        self.alpha, self.low, self.high = alpha, low, high
        self.value = 1.0

    def observe(self, predicted_remaining_s: float, actual_remaining_s: float) -> None:
        """``predicted_remaining_s`` is the uncalibrated prediction (calibration 1)."""
        if predicted_remaining_s <= 0 or actual_remaining_s <= 0:
            return
        ratio = min(self.high, max(self.low, actual_remaining_s / predicted_remaining_s))
        self.value = (1 - self.alpha) * self.value + self.alpha * ratio


class PendingPrefills:
    """Prompt tokens this replica admitted that have not produced a first token yet, and
    the requests it admitted that have not finished: instant and exact, where the engine's
    own counts lag until its thread takes the request in. Once the local engine has taken a
    request in (``taken_in``), its own count covers it (it falls as the prompt's chunks are
    computed, which these books cannot see), so ``untaken`` leaves it out."""

    def __init__(self) -> None:
        self._tokens: dict[str, tuple[str, int]] = {}
        self._untaken: set[str] = set()
        self.tokens_by_location: dict[str, int] = {}
        self.num_open = 0

    def admitted(self, request_id: str, location: str, tokens: int) -> None:
        self._tokens[request_id] = (location, tokens)
        self._untaken.add(request_id)
        self.tokens_by_location[location] = self.tokens_by_location.get(location, 0) + tokens
        self.num_open += 1

    def taken_in(self, request_id: str) -> None:
        """The engine holds the request now: its count of queued prompt tokens includes it."""
        self._untaken.discard(request_id)

    def first_token(self, request_id: str) -> None:
        self._untaken.discard(request_id)
        entry = self._tokens.pop(request_id, None)
        if entry is not None:
            location, tokens = entry
            self.tokens_by_location[location] -= tokens

    def finished(self, request_id: str) -> None:
        self.first_token(request_id)
        self.num_open -= 1

    def tokens(self, location: str) -> int:
        return self.tokens_by_location.get(location, 0)

    def untaken(self, location: str) -> int:
        """Prompt tokens admitted for ``location`` that its engine has not taken in yet."""
        return sum(
            tokens
            for rid, (where, tokens) in self._tokens.items()
            if where == location and rid in self._untaken
        )
