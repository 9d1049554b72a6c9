"""What the front door observes of overload, and the shares of the SLO it may spend on it:
the decode pool's last sheds (``ShedHint``), the lag of Serve's proxy (``ProxyLag``), and
the rules that turn the ingress's own lag into a shed. Pure logic: callers pass times in.
"""

from __future__ import annotations

from pdserve.deployments.admission.rules import Priority

__all__ = [
    "ProxyLag",
    "ShedHint",
    "admission_ack_timeout_s",
    "ingress_overloaded",
    "stream_lag_budget_s",
]


# How long a decode replica counts as routable after the ingress last heard from it (a
# shed, an ack or a first token): long enough that a replica streaming long requests is not
# forgotten between its first tokens, short enough that a gone replica stops keeping the
# door open (a request routed to the shedding one is shed by it again, never lost).
SEEN_WINDOW_S = 30.0


class ShedHint:
    """The ingress's memory of the decode pool's last sheds: after a replica shed a request
    of class ``c`` with a predicted drain time ``d``, a request of that class arriving within
    ``d`` would be predicted over its threshold there too (the drain time is exactly how long
    the queue ahead needs). Batch sheds at a lower threshold, so an interactive shed implies
    a batch one. The window is the Retry-After clients were told, never longer.

    Hints are kept per decode replica, and the door closes for a class only while every
    routable replica (one the ingress heard from within ``seen_window_s``, ``seen``) has an
    active hint for it: then the ingress answers 429 at once with the time until the first
    of them drains, without a hop to a replica whose event loop is busy streaming. While
    another replica has room the request goes to the pool. A shed that names no replica
    (``replica=None``) closes the door for the whole pool, as does the shed of the only
    replica the ingress knows.

    ``max_window_s`` bounds a window: past it the next requests reach a replica, which
    sheds them again from its queue as it is then. A drain time is a prediction, and a
    pessimistic one would otherwise leave the engine idle for all of it (docs/tuning.md).

    What a client is told to wait (``retry_after_s``) is the pool's, not one replica's: the
    time until the first routable replica drains by its own prediction (uncapped), so a
    client shed by a replica with a long queue is not sent away for all of it while another
    replica has room."""

    def __init__(
        self, max_window_s: float | None = None, seen_window_s: float = SEEN_WINDOW_S
    ) -> None:
        if max_window_s is not None and max_window_s <= 0:
            raise ValueError(f"max_window_s must be > 0, got {max_window_s}")
        if seen_window_s <= 0:
            raise ValueError(f"seen_window_s must be > 0, got {seen_window_s}")
        self.max_window_s = max_window_s
        self.seen_window_s = seen_window_s
        self._until: dict[str | None, dict[str, float]] = {}  # replica (None: pool) -> class
        self._drained: dict[str | None, dict[str, float]] = {}  # the same, uncapped
        self._seen: dict[str, float] = {}  # replica -> when last heard from

    def seen(self, replica: str, now: float) -> None:
        """The ingress heard from ``replica`` (it is routable)."""
        self._seen[replica] = now

    def shed(
        self, priority: Priority, now: float, drain_s: float, replica: str | None = None
    ) -> None:
        """``replica`` (None: unknown, taken as the pool) shed a request of this class."""
        classes: tuple[Priority, ...] = (
            ("interactive", "batch") if priority == "interactive" else ("batch",)
        )
        window_s = drain_s if self.max_window_s is None else min(drain_s, self.max_window_s)
        if replica is not None:
            self._seen[replica] = now
        until = self._until.setdefault(replica, {})
        drained = self._drained.setdefault(replica, {})
        for c in classes:
            until[c] = max(until.get(c, 0.0), now + window_s)
            drained[c] = max(drained.get(c, 0.0), now + drain_s)

    def remaining_s(self, priority: Priority, now: float) -> float:
        """Seconds this class is still shed by the whole pool (0 = send it to the pool)."""
        self._forget(now)
        pool = self._left(None, priority, now)
        replicas = [self._left(r, priority, now) for r in self._seen]
        return max(pool, min(replicas, default=0.0))

    def retry_after_s(self, priority: Priority, now: float) -> float:
        """Seconds until the first routable replica has drained the queue it shed this
        class for, by its own prediction (0: one has room now). The Retry-After of a shed."""
        self._forget(now)
        pool = self._left(None, priority, now, self._drained)
        replicas = [self._left(r, priority, now, self._drained) for r in self._seen]
        return max(pool, min(replicas, default=0.0))

    def _left(
        self,
        replica: str | None,
        priority: Priority,
        now: float,
        until: dict[str | None, dict[str, float]] | None = None,
    ) -> float:
        table = self._until if until is None else until
        return max(0.0, table.get(replica, {}).get(priority, 0.0) - now)

    def _forget(self, now: float) -> None:
        """Drop replicas not heard from within ``seen_window_s`` (gone, or scaled down)."""
        for r in [r for r, at in self._seen.items() if now - at > self.seen_window_s]:
            del self._seen[r]
            self._until.pop(r, None)
            self._drained.pop(r, None)


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
    about a sixth of it (measurements: docs/tuning.md)."""
    if reject_within_s <= 0:
        raise ValueError(f"reject_within_s must be > 0, got {reject_within_s}")
    return reject_within_s / 6


# The share of ``reject_within_s`` the ingress waits, from a request's arrival, for the decode
# replica's admission decision; the rest is for the 429 itself, whose response waits for the
# ingress's loop (docs/tuning.md).
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
