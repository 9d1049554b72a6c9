"""Admission control: predict a request's time to first token from everything queued ahead
of it, and admit it or shed it (HTTP 429 with a Retry-After from the predicted drain time).

Where the decision runs: on the decode replica that received the request, before any work.
That replica knows its own queue exactly and at once (the requests it admitted and has not
given a first token yet, its engine's running batch and step time, the prefill work it sent
to the prefill pool), while the routing stats an ingress could read lag by a stats period,
so a burst arriving within one period would all be admitted against an empty queue (the
failure of issue 18). Serve's own queue in front of the replica is not invisible here:
every request carries its arrival time, so the time it already waited is part of its
prediction, and Serve's queue stays short because a shed answer frees its slot within
milliseconds (``app.py`` bounds that queue too). Its wait is not bounded though: on a
contended CPU the ingress's and the replica's loops take a request in behind their streams,
and a shed decided after that reaches the client that late. So, with
``policy.admission_timeout``, the ingress asks for the decision as an ack
(``GenerateRequest.admit_by``) and answers 429 itself when neither the ack nor the
replica's 429 came within half of ``policy.reject_within_ms`` (``admission_ack_timeout_s``);
the request carries that deadline (``admit_by``), past which the replica drops it
unanswered, so the ingress never cancels a call Serve may still be routing.

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
    from pdserve.deployments.config import PolicyConfig, SLOConfig

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

    @property
    def remaining_s(self) -> float:
        """From now until the first token (what a request arriving now would still wait)."""
        return self.calibration * (self.slot_wait_s + self.prefill_s + self.first_step_s)

    @property
    def total_s(self) -> float:
        return self.waited_s + self.remaining_s


@dataclass(frozen=True)
class AdmissionRules:
    """Per-class thresholds, from ``PolicyConfig`` and the SLO (see ``config.py``)."""

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
        cls, policy: PolicyConfig, slo: SLOConfig, max_admitted: int = 0
    ) -> AdmissionRules:
        """The rules of an application's ``policy`` and ``slo`` sections."""
        slo_s = slo.ttft_ms / 1000.0
        return cls(
            ttft_slo_s=slo_s,
            interactive_factor=policy.shed_ttft_factor,
            batch_factor=policy.batch_shed_ttft_factor,
            interactive_on_miss=policy.on_slo_miss,
            batch_on_miss=policy.batch_on_slo_miss,
            interactive_max_wait_s=policy.max_queue_wait_factor * slo_s,
            batch_max_wait_s=policy.batch_max_queue_wait_s,
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
    reason: str  # admitted | queued_past_slo | unmeasured | ttft_slo | queue_full | deadline
    predicted_ttft_s: float
    retry_after_s: float | None  # set when shed


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
    return TTFTPrediction(
        waited_s=max(0.0, q.waited_s),
        slot_wait_s=slot_wait_s(q),
        prefill_s=prefill_s,
        first_step_s=q.step_s,
        calibration=calibration,
        measured=q.rate_measured,
    )


# A shed's drain time is never shorter than this (a request just over its threshold).
MIN_DRAIN_S = 0.1


def retry_after_s(prediction: TTFTPrediction, threshold_s: float) -> float:
    """Seconds until the queue ahead has drained enough that a request arriving then is
    predicted under ``threshold_s``: exact, since the ingress sheds the class at its door
    for that long (``ShedHint``; rounded up to whole seconds, at least 1, the window could
    leave the engine idle for up to a second after every shed). The HTTP ``Retry-After``
    header rounds it up to whole seconds."""
    return max(MIN_DRAIN_S, prediction.remaining_s - threshold_s)


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
    own counts lag until its thread takes the request in."""

    def __init__(self) -> None:
        self._tokens: dict[str, tuple[str, int]] = {}
        self.tokens_by_location: dict[str, int] = {}
        self.num_open = 0

    def admitted(self, request_id: str, location: str, tokens: int) -> None:
        self._tokens[request_id] = (location, tokens)
        self.tokens_by_location[location] = self.tokens_by_location.get(location, 0) + tokens
        self.num_open += 1

    def first_token(self, request_id: str) -> None:
        entry = self._tokens.pop(request_id, None)
        if entry is not None:
            location, tokens = entry
            self.tokens_by_location[location] -= tokens

    def finished(self, request_id: str) -> None:
        self.first_token(request_id)
        self.num_open -= 1

    def tokens(self, location: str) -> int:
        return self.tokens_by_location.get(location, 0)


class ShedHint:
    """The ingress's memory of the decode pool's last sheds: after a replica shed a request
    of class ``c`` with a predicted drain time ``d``, a request of that class arriving within
    ``d`` would be predicted over its threshold too (the drain time is exactly how long the
    queue ahead needs), so the ingress answers it 429 at once with the time left, without a
    hop to a replica whose event loop is busy streaming. Batch sheds at a lower threshold,
    so an interactive shed implies a batch one. An approximation with several decode
    replicas (the router sends each request to the least loaded one, so a shed means all
    are loaded); the window is the Retry-After clients were told, never longer.

    ``max_window_s`` bounds a window: past it the next requests reach a replica, which
    sheds them again from its queue as it is then. A drain time is a prediction, and a
    pessimistic one (measured: a replica hit by a burst predicted 13 s for a queue that
    drained in under 1 s) would otherwise leave the engine idle for all of it."""

    def __init__(self, max_window_s: float | None = None) -> None:
        if max_window_s is not None and max_window_s <= 0:
            raise ValueError(f"max_window_s must be > 0, got {max_window_s}")
        self.max_window_s = max_window_s
        self._until: dict[str, float] = {}

    def shed(self, priority: Priority, now: float, drain_s: float) -> None:
        classes: tuple[Priority, ...] = (
            ("interactive", "batch") if priority == "interactive" else ("batch",)
        )
        if self.max_window_s is not None:
            drain_s = min(drain_s, self.max_window_s)
        for c in classes:
            self._until[c] = max(self._until.get(c, 0.0), now + drain_s)

    def remaining_s(self, priority: Priority, now: float) -> float:
        """Seconds this class is still shed (0 = send it to the pool)."""
        return max(0.0, self._until.get(priority, 0.0) - now)


class ProxyLag:
    """How long Serve's HTTP proxy takes to hand this ingress a request body: the proxy
    streams bodies to the replica on demand, through its own event loop, so a proxy falling
    behind (busy, or starved of CPU) shows here, while every new request also waits in that
    loop before any pdserve code sees it. An EMA of the body reads, trusted for ``hold_s``
    after the last one: while the ingress sheds on it no body is read, so the value must
    expire and let requests through to measure again (a duty cycle, not a latch); after
    such a gap it starts again from 0."""

    def __init__(self, alpha: float = 0.3, hold_s: float = 1.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if hold_s <= 0:
            raise ValueError(f"hold_s must be > 0, got {hold_s}")
        self.alpha, self.hold_s = alpha, hold_s
        self._value = 0.0
        self._at: float | None = None

    def observe(self, seconds: float, now: float) -> None:
        """A body read that took ``seconds``, finished at ``now``."""
        previous = self.seconds(now)  # 0 after a gap: one slow read alone sheds little
        self._value = self.alpha * max(0.0, seconds) + (1 - self.alpha) * previous
        self._at = now

    def seconds(self, now: float) -> float:
        """The proxy's current lag (0 once no body was read for ``hold_s``)."""
        if self._at is None or now - self._at > self.hold_s:
            return 0.0
        return self._value


# Shares of the TTFT SLO the front door may lag before the ingress sheds (interactive;
# batch yields at half): its own event loop, and that loop plus Serve's proxy.
LOOP_LAG_SHARE = 0.1
PROXY_LAG_SHARE = 0.25


def stream_lag_budget_s(reject_within_s: float) -> float:
    """How long the ingress's loop may lag (its mean, ``LoopLag``) before its stream bound is
    cut: every 429 waits in that loop, and a p99 within ``reject_within_s`` leaves the mean
    about a sixth of it. Measured on the 2-core VM (colocated 10x step, 429s within 100 ms):
    a mean lag near 50 ms put the 429 p99 at 140 ms; with a quarter (25 ms) four runs had
    35-120 ms; with a sixth eight had 24-92 ms."""
    if reject_within_s <= 0:
        raise ValueError(f"reject_within_s must be > 0, got {reject_within_s}")
    return reject_within_s / 6


# The share of ``reject_within_s`` the ingress waits, from a request's arrival, for the decode
# replica's admission decision; the rest is for the 429 itself: its response waits for the
# ingress's loop, which lagged up to 150 ms at a 10x step's onset on the 2-core VM (with 0.7,
# those 429s came in 144-219 ms).
ACK_SHARE = 0.5


def admission_ack_timeout_s(reject_within_s: float, waited_s: float) -> float:
    """How long the ingress still waits for the decode replica's admission decision (its
    ack or its 429) on a request that arrived ``waited_s`` ago, before it answers the 429
    itself: a decision that comes late (the path to the replica, or its loop, behind other
    work), a shed included, would answer the client as late. Never less than a quarter of
    that share: a request the ingress itself was slow to reach gets a short chance (its own
    loop lag sheds at the door)."""
    if reject_within_s <= 0:
        raise ValueError(f"reject_within_s must be > 0, got {reject_within_s}")
    budget = ACK_SHARE * reject_within_s
    return max(budget / 4, budget - max(0.0, waited_s))


def ingress_overloaded(
    loop_lag_s: float, priority: Priority, ttft_slo_s: float, proxy_lag_s: float = 0.0
) -> bool:
    """Whether the front door itself is the queue. Every request and every streamed chunk
    waits for the ingress's event loop, twice before a first token reaches the client (the
    request in, the chunk out, each behind the backlog that the lag measures), and a loop
    lag that grew to a tenth of the SLO grows on while requests keep coming: shed there.
    Serve's proxy (``proxy_lag_s``, see ``ProxyLag``) is a queue every request waited in
    before the ingress saw it; its measure is one body read, noisier on a busy node, so
    the two together may take a quarter of the SLO (the engine keeps the rest). Batch
    yields first, at half those shares."""
    scale = 1.0 if priority == "interactive" else 0.5
    return (
        loop_lag_s > LOOP_LAG_SHARE * scale * ttft_slo_s
        or loop_lag_s + proxy_lag_s > PROXY_LAG_SHARE * scale * ttft_slo_s
    )


class StreamLimit:
    """An adaptive bound on the streams an ingress holds open (admitted, not finished).

    The decode replica's prediction covers the engine's queue. The rest of the serving path
    (the event loops of the ingress and decode replicas, Ray's object transfers, the HTTP
    writes) keeps no queue anyone can count, yet every open stream costs it per token: on a
    shared CPU a burst the engine could take piles up there, and its first tokens come
    seconds late although every prediction said they would not (issue 18: 40 requests
    admitted within half a second, each predicted under 3 s, took 4.2 s), while the 429s
    the door owes everyone else wait behind the same loop. So the ingress bounds its open
    streams by what it observes of the path, TCP's congestion window with the SLO as the
    delay target (the scheme of Envoy's adaptive concurrency filter and Netflix's
    concurrency-limits). Two signals: the time to first token of its streams, and the lag
    of its own event loop, through which every 429 passes (``lag_budget_s``):

    - a first token within half the target, the loop within half its budget, and the bound
      nearly in use when the request was admitted: grow, by one (slow start, until the
      first sign of a queue) or by one per window (``1 / limit`` a sample);
    - a first token within the target and the loop within its budget: hold, and leave slow
      start (a queue has started to build);
    - past either: cut to ``decrease`` x the streams that were open, but at most by half (one
      slow first token at low load must not leave a bound of one), and at most once per
      round trip (only a request admitted after the last cut can show its effect).

    A request the decode replica shed (its own queue predicted past the SLO) is the same
    signal as a late first token (TCP's loss beside its delay): the door, not the replica,
    should be turning that traffic away, at once.

    A first token the decode replica predicted late (a long prompt, a queue its admission
    control accepted) is late by the engine's work, not the path's: the target is then the
    prediction plus half the target (a quarter for growth), so a long prompt does not shrink
    the bound that the short ones need.

    Growth only while the bound is in use keeps it near what the traffic needs, so a burst
    after a quiet spell meets a bound the quiet traffic set, not one it never tested. Batch
    may hold ``batch_share`` of it: it sheds first. Pure logic: callers pass times in."""

    def __init__(
        self,
        target_s: float,
        high: int,
        lag_budget_s: float = float("inf"),
        initial: int = 8,
        low: int = 1,
        decrease: float = 0.7,
        batch_share: float = 0.75,
    ) -> None:
        if target_s <= 0:
            raise ValueError(f"target_s must be > 0, got {target_s}")
        if lag_budget_s <= 0:
            raise ValueError(f"lag_budget_s must be > 0, got {lag_budget_s}")
        if not 1 <= low <= high:
            raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
        if not 0 < decrease < 1:
            raise ValueError(f"decrease must be in (0, 1), got {decrease}")
        if not 0 < batch_share <= 1:
            raise ValueError(f"batch_share must be in (0, 1], got {batch_share}")
        self.target_s, self.lag_budget_s, self.low, self.high = target_s, lag_budget_s, low, high
        self.decrease, self.batch_share = decrease, batch_share
        self.limit = float(min(high, max(low, initial)))
        self.slow_start = True
        self._cut_at = float("-inf")

    def admits(self, priority: Priority, num_open: int) -> bool:
        """Whether one more stream of this class fits beside the ``num_open`` ones."""
        bound = self.limit if priority == "interactive" else self.batch_share * self.limit
        return num_open < max(self.low, bound)

    def observe(
        self,
        ttft_s: float,
        admitted_at: float,
        open_at_admission: int,
        now: float,
        loop_lag_s: float = 0.0,
        predicted_s: float = 0.0,
    ) -> None:
        """A first token after ``ttft_s``, for a request admitted at ``admitted_at`` with
        ``open_at_admission`` streams open then (itself not counted); ``loop_lag_s``: the
        ingress's event loop lag now; ``predicted_s``: the decode replica's prediction of
        this TTFT (0 = none)."""
        late_s = max(self.target_s, predicted_s + self.target_s / 2)
        fast_s = max(self.target_s / 2, predicted_s + self.target_s / 4)
        if ttft_s > late_s or loop_lag_s > self.lag_budget_s:
            self._cut(admitted_at, open_at_admission, now)
        elif ttft_s > fast_s or loop_lag_s > self.lag_budget_s / 2:
            self.slow_start = False
        elif open_at_admission + 2 >= self.limit:
            step = 1.0 if self.slow_start else 1.0 / self.limit
            self.limit = min(float(self.high), self.limit + step)

    def check_loop(self, loop_lag_s: float, num_open: int, now: float) -> None:
        """The loop's lag, at every request the door sees: past the budget, cut without
        waiting for a first token (a flood's onset lags the loop before any stream it
        admitted has one), at most every quarter of the target, the time the streams
        open then take to give way."""
        if loop_lag_s > self.lag_budget_s and now - self._cut_at >= self.target_s / 4:
            self._cut_to(num_open, now)

    def refused(self, admitted_at: float, open_at_admission: int, now: float) -> None:
        """The decode replica shed a request this door let through: cut, as for a late
        first token."""
        self._cut(admitted_at, open_at_admission, now)

    def _cut(self, admitted_at: float, open_at_admission: int, now: float) -> None:
        self.slow_start = False
        if admitted_at > self._cut_at:  # once per round trip
            self._cut_to(open_at_admission + 1, now)

    def _cut_to(self, num_open: int, now: float) -> None:
        """``decrease`` x the streams in use, at most a halving, never below ``low``."""
        self.slow_start = False
        in_use = min(self.limit, num_open)
        self.limit = max(float(self.low), self.decrease * in_use, self.limit / 2)
        self._cut_at = now

    def drain_s(self, mean_stream_s: float, num_open: int) -> float:
        """When a slot is expected to free: streams end every ``mean_stream_s / num_open``."""
        if num_open <= 0 or mean_stream_s <= 0:
            return MIN_DRAIN_S
        return max(MIN_DRAIN_S, mean_stream_s / num_open)
