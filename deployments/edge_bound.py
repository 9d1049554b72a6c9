"""``EdgeBound``: a Serve proxy's copy of the ingress door's bound on open streams.

A proxy in front of the ingress would otherwise learn that the door is full only from the
door's first 429 (``door_gate.EdgeLatch``). Until that answer comes back, a flood's requests
each cost the proxy a Ray call on its one event loop, and their 429s come late. With the
bound, the proxy answers the door's "concurrency" 429 itself from the flood's first
request on.

Every HTTP response of an ingress replica states its door's bound (``STREAMS_HEADER``, set
by ``DoorGate``, dropped by ``EdgeGate`` before a client sees it): the replica, the bound of
each class, how long a stream stays open, and whether the replica checks API keys. The
proxy counts the generate requests it forwarded that have not ended. The door counts the
same streams, and other proxies' too. So while the proxy's count is at the sum of the
replicas' bounds, the door could only refuse one more (give or take the moment a request
takes to arrive or an ended stream's last bytes take to come back), and the proxy answers
that 429 itself. Where the replicas check API keys it does so only for credentials the
door has let through, so a wrong key still gets the ingress's 401. Pure logic: callers
pass the headers in and count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.deployments.admission.front_door import DoorShed, StreamBounds, door_shed
from pdserve.deployments.admission.rules import Priority
from pdserve.deployments.admission.stream_limit import drain_s

STREAMS_HEADER = "x-pdserve-streams"
# A replica not heard from for this long while another was is gone (scaled down, replaced):
# its bound no longer counts. A quiet spell forgets nothing: the doors' bounds do not move
# without traffic, and the first burst after an outage is the one to answer fast.
STALE_S = 30.0
# While the proxy answers for the doors, one request this often still goes to a door, so
# that the bound it answers by is never older than this (a bound raised, or taken off).
REFRESH_S = 1.0
MAX_CALLERS = 1024

Credentials = tuple[str, str]  # Authorization, X-Api-Key


def streams_header(replica: str, bounds: StreamBounds, keyed: bool) -> str:
    """``STREAMS_HEADER``'s value for a replica's door (``keyed``: it checks API keys)."""
    batch = "-" if bounds.batch is None else f"{bounds.batch:g}"
    return (
        f"replica={replica};interactive={bounds.interactive:g};batch={batch};"
        f"stream_s={bounds.stream_s:.3g};keyed={int(keyed)}"
    )


@dataclass(frozen=True)
class ReplicaBound:
    replica: str
    bounds: StreamBounds
    keyed: bool


def parse_streams_header(value: str) -> ReplicaBound | None:
    """The header's bound; None for a value that does not parse."""
    fields = dict(item.partition("=")[::2] for item in value.split(";"))
    try:
        batch = fields["batch"]
        bounds = StreamBounds(
            interactive=float(fields["interactive"]),
            batch=None if batch == "-" else float(batch),
            stream_s=float(fields["stream_s"]),
        )
        keyed = fields["keyed"] == "1"
        replica = fields["replica"]
    except (KeyError, ValueError):
        return None
    return ReplicaBound(replica, bounds, keyed)


@dataclass
class _Heard:
    value: str
    bound: ReplicaBound
    at: float


class EdgeBound:
    """What a proxy knows of the doors' bounds, and the requests it has in flight to them."""

    def __init__(
        self,
        stale_s: float = STALE_S,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < refresh_s <= stale_s:
            raise ValueError(f"need 0 < refresh_s <= stale_s, got {refresh_s}, {stale_s}")
        self.stale_s, self.refresh_s = stale_s, refresh_s
        self._clock = clock
        self._replicas: dict[str, _Heard] = {}
        self._callers: set[Credentials] = set()
        self._heard_at = float("-inf")  # the last time any replica stated its bound
        self._probed_at = float("-inf")
        self.in_flight = 0  # generate requests forwarded, not yet ended

    def heard(self, value: str) -> None:
        """A response carried ``STREAMS_HEADER`` with this value."""
        now = self._heard_at = self._clock()
        name = value.partition(";")[0]
        known = self._replicas.get(name)
        if known is not None and known.value == value:
            known.at = now
            return
        bound = parse_streams_header(value)
        if bound is not None:
            self._replicas[name] = _Heard(value, bound, now)

    def unbounded(self) -> None:
        """A door served a request and stated no bound: its streams are not bounded (the
        application was redeployed so); forget every bound."""
        self._replicas.clear()

    def passed(self, credentials: Credentials) -> None:
        """The door let a request with these credentials through, or refused it for load:
        they pass its API key check."""
        if len(self._callers) >= MAX_CALLERS:
            self._callers.clear()  # many callers' keys: start afresh, never grow unbounded
        self._callers.add(credentials)

    def refusal(self, priority: Priority, credentials: Credentials) -> DoorShed | None:
        """The door's concurrency 429 for one more request of this class now; None: forward
        it (the doors have room, no bound is known, the credentials are not known, or it
        goes to refresh the bound)."""
        if not self._replicas:
            return None
        heard = self._live()
        if any(h.bound.keyed for h in heard) and credentials not in self._callers:
            return None
        total = 0.0
        for h in heard:
            bounds = h.bound.bounds
            bound = bounds.interactive if priority == "interactive" else bounds.batch
            if bound is None:
                return None  # this class is not bounded
            total += bound
        if self.in_flight < total:
            return None
        now = self._clock()
        if now - self._heard_at >= self.refresh_s and now - self._probed_at >= self.refresh_s:
            self._probed_at = now
            return None
        stream_s = max(h.bound.bounds.stream_s for h in heard)
        return door_shed("concurrency", priority, drain_s(stream_s, self.in_flight))

    def _live(self) -> list[_Heard]:
        """The replicas heard from within ``stale_s`` of the last one heard."""
        heard = list(self._replicas.values())
        if any(self._heard_at - h.at > self.stale_s for h in heard):
            self._replicas = {
                k: h for k, h in self._replicas.items() if self._heard_at - h.at <= self.stale_s
            }
            heard = list(self._replicas.values())
        return heard
