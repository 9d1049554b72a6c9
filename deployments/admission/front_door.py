"""``FrontDoor``: an ingress replica's overload control, the one owner of it on that side.

The ingress asks ``admit`` once per request, before reading its body, and answers 429 when
the door says so: every decode replica it knows shed this class within its drain time
(``ShedHint``),
the front door itself is the queue (the ingress's event loop, or Serve's proxy in front of
it), or the adaptive bound on open streams is reached (``StreamLimit``). A request let
through holds a ``DoorPass``, counted against the bound at once: requests arriving together
can not all pass before any of them opens its stream. Around each
decode call the ingress reports what happened (``opened``, ``first_token``, ``refused``,
``closed``), and the door keeps the turned-away demand it reports to the decode pool for
its autoscaling policy. It never calls Serve itself: ``report_turned_away`` is the
ingress's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.deployments.admission.rules import MIN_DRAIN_S, Priority
from pdserve.deployments.admission.signals import (
    ProxyLag,
    ShedHint,
    admission_ack_timeout_s,
    ingress_overloaded,
    stream_lag_budget_s,
)
from pdserve.deployments.admission.stream_limit import StreamLimit, drain_s
from pdserve.deployments.load import Ema, LoopLag

if TYPE_CHECKING:
    from pdserve.deployments.config import AppConfig

RETRY_AFTER_S = 1.0
TURNED_AWAY_REPORT_S = 1.0  # how often the door's capacity sheds are reported to the pool


@dataclass(frozen=True)
class FrontDoorSettings:
    """How an ingress replica guards its door (``from_config``: an application's)."""

    ttft_slo_s: float | None = None  # None: shedding is off (nothing sheds at the door)
    max_streams: int | None = None  # the adaptive stream bound's ceiling; None = no bound
    limit_batch: bool = True  # the bound and the ack timeout apply to batch too
    reject_within_s: float = 0.1  # how fast a 429 should be answered (p99)
    admission_timeout: bool = False  # answer 429 here when the decode pool decides late

    def __post_init__(self) -> None:
        if self.ttft_slo_s is not None and self.ttft_slo_s <= 0:
            raise ValueError(f"ttft_slo_s must be > 0, got {self.ttft_slo_s}")
        if self.max_streams is not None and self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if self.reject_within_s <= 0:
            raise ValueError(f"reject_within_s must be > 0, got {self.reject_within_s}")

    @classmethod
    def from_config(cls, cfg: AppConfig) -> FrontDoorSettings:
        a = cfg.admission
        return cls(
            ttft_slo_s=cfg.slo.ttft_ms / 1000.0 if a.on_slo_miss == "shed" else None,
            max_streams=cfg.ingress_ongoing_limit if a.adaptive_concurrency else None,
            limit_batch=a.batch_on_slo_miss == "shed",
            reject_within_s=a.reject_within_ms / 1000.0,
            admission_timeout=a.admission_timeout,
        )


@dataclass(frozen=True)
class DoorShed:
    """A 429 the door answers itself."""

    reason: str
    message: str
    retry_after_s: float


def door_shed(reason: str, priority: Priority, wait_s: float) -> DoorShed:
    """The door's refusal of a request of this class, its queue draining in ``wait_s``."""
    message = (
        f"overloaded ({reason}): predicted time to first token over what a "
        f"{priority} request may wait; the queue drains in {wait_s:.1f}s"
    )
    return DoorShed(reason, message, wait_s)


@dataclass(frozen=True)
class StreamBounds:
    """The door's bound on open streams as it stands: what a Serve proxy in front of the
    ingress mirrors (``edge_bound.EdgeBound``)."""

    interactive: float  # an interactive request fits while fewer streams are in use
    batch: float | None  # the same for batch; None: batch is not bounded
    stream_s: float  # how long a stream stays open (mean; 0 before the first one ends)


@dataclass
class DoorPass:
    """A request the door let through, counted against the stream bound until its stream
    opens (``FrontDoor.opened``) or it never will (``FrontDoor.release``)."""

    held: bool = True


@dataclass(frozen=True)
class Ticket:
    """One request let through to the decode pool."""

    priority: Priority
    admitted_at: float  # monotonic
    open_before: int  # streams open when it was let through (itself not counted)


class LoopLagSignal(Protocol):
    """The ingress's event-loop lag (``LoopLag``; tests pass a fake)."""

    @property
    def seconds(self) -> float: ...

    def ensure_running(self) -> None: ...


class DoorMetrics(Protocol):
    def record_shed(self, reason: str, slo_class: str, n: int = 1) -> None: ...

    def record_streams(self, num_open: int, limit: float | None) -> None: ...


class TurnedAway:
    """Requests turned away for lack of decode capacity (the pool's drain hint, or Serve's
    queue for the pool full) and not yet reported to the pool: its autoscaling policy
    counts them as demand (``DecodeServer.report_turned_away``). Sheds on the front door's
    own lag are not counted: more decode replicas would not fix them. Reported at most
    every ``period_s``, so a flood costs one call a second."""

    def __init__(self, period_s: float = TURNED_AWAY_REPORT_S) -> None:
        self.period_s = period_s
        self.pending = 0
        self._last: float | None = None

    def add(self, n: int = 1) -> None:
        self.pending += n

    def take(self, now: float) -> int:
        """The count to report now (0: nothing pending, or reported under ``period_s`` ago)."""
        if not self.pending or (self._last is not None and now - self._last < self.period_s):
            return 0
        n, self.pending, self._last = self.pending, 0, now
        return n


class FrontDoor:
    """An ingress replica's door: what it sheds before any work, and its open streams."""

    def __init__(
        self,
        settings: FrontDoorSettings,
        metrics: DoorMetrics,
        report_turned_away: Callable[[int], None],
        streams: StreamLimit | None = None,
        *,
        loop_lag: LoopLagSignal | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``report_turned_away(n)`` sends a count of capacity sheds to the decode pool
        (the ingress runs it in the background); ``streams`` replaces the stream bound the
        settings would build; ``loop_lag`` and ``clock`` (monotonic seconds) replace the
        ingress's own loop lag and clock (tests)."""
        self.settings = settings
        self._clock = clock
        self._metrics = metrics
        self._report = report_turned_away
        slo_s = settings.ttft_slo_s
        # The decode pool's last sheds, for at most half the TTFT SLO: then a replica is
        # asked again (its drain time is a prediction, and a pessimistic one would idle the
        # engine).
        self.shed_hint = ShedHint(max_window_s=slo_s / 2 if slo_s else None)
        self.loop_lag: LoopLagSignal = loop_lag if loop_lag is not None else LoopLag()
        self.proxy_lag = ProxyLag()
        self.turned_away = TurnedAway()
        if streams is None and settings.max_streams and slo_s is not None:
            streams = StreamLimit(
                slo_s,
                high=settings.max_streams,
                lag_budget_s=stream_lag_budget_s(settings.reject_within_s),
            )
        self.streams = streams
        self.num_open = 0
        self.num_passed = 0  # let through, stream not yet opened (``DoorPass``es held)
        self.stream_s = Ema()  # how long a stream stays open

    # ------------------------------------------------------------------ before any work
    def admit(self, priority: Priority) -> DoorShed | DoorPass:
        """``check``, and for a request let through its pass: it counts against the
        stream bound from now until its stream opens, or ``release`` when it never does."""
        shed = self.check(priority)
        if shed is not None:
            return shed
        self.num_passed += 1
        return DoorPass()

    def release(self, door_pass: DoorPass) -> None:
        """The request ends without its stream (or its stream already opened): drop its
        place. Idempotent."""
        if door_pass.held:
            door_pass.held = False
            self.num_passed -= 1

    def check(self, priority: Priority) -> DoorShed | None:
        """The 429 for a request of this class arriving now, or None to let it through.
        Recorded as a shed; capacity sheds count as turned-away demand."""
        self.loop_lag.ensure_running()
        now = self._clock()
        self._send_report(now)
        loop_lag, proxy_lag = self.loop_lag.seconds, self.proxy_lag.seconds(now)
        wait_s = self.shed_hint.remaining_s(priority, now)
        reason = "drain_hint" if wait_s > 0 else ""
        if reason:
            self.turned_away.add()  # the pool is full: demand it did not see
        slo_s = self.settings.ttft_slo_s
        if not reason and slo_s is not None:
            if ingress_overloaded(loop_lag, priority, slo_s):
                reason = "ingress_lag"
            elif ingress_overloaded(loop_lag, priority, slo_s, proxy_lag_s=proxy_lag):
                reason = "proxy_lag"
            wait_s = 2 * (loop_lag + proxy_lag)  # the lag in, and again out
        if not reason and (drain_s := self._stream_drain_s(priority)) is not None:
            reason, wait_s = "concurrency", drain_s
            self.turned_away.add()  # the pool, as far as this door can feed it, is full
        if not reason:
            return None
        self._metrics.record_shed(reason, priority)
        return door_shed(reason, priority, wait_s)

    def edge_refused(self, priority: Priority, n: int) -> None:
        """A Serve proxy answered ``n`` requests of this class with this door's last refusal
        (``door_gate.EdgeLatch``): counted as sheds (``proxy_edge``) and as turned-away
        demand, like the door's own capacity sheds."""
        if n > 0:
            self._metrics.record_shed("proxy_edge", priority, n)
            self.turned_away.add(n)

    def body_wait(self, seconds: float) -> None:
        """Serve's proxy took ``seconds`` to hand over a request body's first chunk."""
        self.proxy_lag.observe(seconds, self._clock())

    def ack_timeout_s(self, priority: Priority, arrival_time: float | None) -> float | None:
        """How long to wait for the decode replica's admission decision before answering
        429 here (``admission_ack_timeout_s``); None: as long as it takes (the timeout is
        off, or a batch request that queues)."""
        s = self.settings
        if not s.admission_timeout or s.ttft_slo_s is None:
            return None
        if priority == "batch" and not s.limit_batch:
            return None
        waited = time.time() - arrival_time if arrival_time is not None else 0.0
        return admission_ack_timeout_s(s.reject_within_s, waited)

    # ------------------------------------------------------------------ around a decode call
    def opened(self, priority: Priority, door_pass: DoorPass | None = None) -> Ticket:
        """A request goes to the decode pool; ``door_pass``: the place ``admit`` held for
        it, now taken by the stream (None, or one already taken: a stream of its own, the
        next choice of an ``n`` > 1 request)."""
        if door_pass is not None:
            self.release(door_pass)
        ticket = Ticket(priority, self._clock(), self.num_open + self.num_passed)
        self.num_open += 1
        self._metrics.record_streams(self.num_open, self.stream_limit)
        return ticket

    def first_token(self, ticket: Ticket, predicted_s: float | None) -> None:
        """Its first token reached the ingress: the TTFT the serving path gave it, against
        the one the decode replica predicted (None: none)."""
        if self.streams is not None:
            now = self._clock()
            self.streams.observe(
                now - ticket.admitted_at,
                ticket.admitted_at,
                ticket.open_before,
                now,
                self.loop_lag.seconds,
                predicted_s or 0.0,
            )

    def heard_from(self, replica: str) -> None:
        """A decode replica answered (an ack or a first token): it is routable."""
        self.shed_hint.seen(replica, self._clock())

    def refused(self, ticket: Ticket, retry_after_s: float, replica: str | None = None) -> float:
        """The decode replica ``replica`` (None: unknown) shed it, its queue draining in
        ``retry_after_s``. Returns the Retry-After to answer: the pool's, until the first
        replica this door knows has room (``ShedHint.retry_after_s``), at most the
        replica's own."""
        now = self._clock()
        self.shed_hint.shed(ticket.priority, now, retry_after_s, replica)
        if self.streams is not None:
            self.streams.refused(ticket.admitted_at, ticket.open_before, now)
        pool_s = self.shed_hint.retry_after_s(ticket.priority, now)
        return min(retry_after_s, max(MIN_DRAIN_S, pool_s))

    def not_admitted_in_time(self, ticket: Ticket) -> DoorShed:
        """The 429 of a request whose admission decision did not come in time: the path to
        the decode pool (Serve's routing, the replica's loop) is the queue. Cuts the stream
        bound like a refusal; counted as turned-away demand."""
        now = self._clock()
        reason = "admission_timeout"
        self._metrics.record_shed(reason, ticket.priority)
        self.turned_away.add()
        wait_s = MIN_DRAIN_S
        if self.streams is not None:
            self.streams.refused(ticket.admitted_at, ticket.open_before, now)
            wait_s = drain_s(self.stream_s.value, self.num_open)
        message = (
            f"overloaded ({reason}): the decode pool did not take the request within "
            f"{now - ticket.admitted_at:.2f}s; retry after {wait_s:.1f}s"
        )
        return DoorShed(reason, message, wait_s)

    def serve_queue_full(self, ticket: Ticket) -> float:
        """Serve's queue for the decode pool is full: overload, answered like a shed and
        counted as turned-away demand. Returns the Retry-After."""
        self._metrics.record_shed("serve_queue_full", ticket.priority)
        self.turned_away.add()
        return max(RETRY_AFTER_S, math.ceil(self.settings.ttft_slo_s or 0.0))

    def closed(self, ticket: Ticket, had_first_token: bool) -> None:
        """The stream ended (finished, refused, failed or its client gone)."""
        self.num_open -= 1
        if had_first_token:
            self.stream_s.add(self._clock() - ticket.admitted_at)
        self._metrics.record_streams(self.num_open, self.stream_limit)

    @property
    def stream_limit(self) -> float | None:
        return self.streams.limit if self.streams is not None else None

    def stream_bounds(self) -> StreamBounds | None:
        """The bound ``check`` applies to each class now; None: open streams are not bounded."""
        limit = self.streams
        if limit is None:
            return None
        batch = limit.bound("batch") if self.settings.limit_batch else None
        return StreamBounds(limit.bound("interactive"), batch, self.stream_s.value)

    # ------------------------------------------------------------------ internals
    def _stream_drain_s(self, priority: Priority) -> float | None:
        """None while a stream of this class fits under the adaptive bound; else when a
        slot is expected to free."""
        limit = self.streams
        if limit is None or (priority == "batch" and not self.settings.limit_batch):
            return None
        in_use = self.num_open + self.num_passed
        if limit.admits(priority, in_use):
            return None
        # A 429 is being answered, and it waits in this loop: only now may its lag cut.
        limit.check_loop(self.loop_lag.seconds, in_use, self._clock())
        return drain_s(self.stream_s.value, self.num_open)

    def _send_report(self, now: float) -> None:
        n = self.turned_away.take(now)
        if n:
            self._report(n)
