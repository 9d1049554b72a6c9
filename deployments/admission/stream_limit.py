"""``StreamLimit``: the ingress's adaptive bound on the streams it holds open. Pure logic:
callers pass times in."""

from __future__ import annotations

from collections import deque

from pdserve.deployments.admission.rules import MIN_DRAIN_S, Priority


class StreamLimit:
    """An adaptive bound on the streams an ingress holds open (admitted, not finished).

    The decode replica's prediction covers the engine's queue. The rest of the serving path
    (the event loops of the ingress and decode replicas, Ray's object transfers, the HTTP
    writes) keeps no queue anyone can count, yet every open stream costs it per token: on a
    shared CPU a burst the engine could take piles up there, and its first tokens come
    seconds late although every prediction said they would not (docs/decisions.md), while
    the 429s the door owes everyone else wait behind the same loop. So the ingress bounds its open
    streams by what it observes of the path, TCP's congestion window with the SLO as the
    delay target (the scheme of Envoy's adaptive concurrency filter and Netflix's
    concurrency-limits). Two signals: the time to first token of its streams, and the lag
    of its own event loop, through which every 429 passes (``lag_budget_s``):

    - a first token within half the target, the loop within half its budget, and the bound
      nearly in use when the request was admitted: grow, by one (slow start, until the
      first sign of a queue) or by one per window (``1 / limit`` a sample);
    - a first token within the target: hold, and leave slow start if it came past half the
      target or the loop lags past half its budget (a queue has started to build);
    - past the target: cut to ``decrease`` x the streams that were open, but at most by half
      (one slow first token at low load must not leave a bound of one), and at most once
      per round trip (only a request admitted after the last cut can show its effect).

    What may cut the bound, and what may not, follows one rule: the door refuses only what
    queueing would have served past the SLO. So:

    - a late first token of a request admitted with no other stream open holds, never cuts:
      no queue of this door's streams was ahead of it (a fresh engine's first steps, a long
      prompt), and a lower bound would not have made it faster;
    - the loop's lag cuts only while the door is turning requests away (``check_loop``):
      it guards the latency of those 429s, and while the traffic fits under the bound there
      is no 429 to guard (on a shared CPU the loop lags with other processes' work, which
      fewer streams would not remove);
    - the concurrency whose first tokens came in time (``sustained``: the most streams open
      at the admission of a request whose first token was not late, within the last
      ``sustained_window_s``) is a floor for every cut but a late first token's, which alone
      shows that concurrency missing the SLO. The floor is evidence about the path as it
      was, so it expires like BBR's windowed maximum of delivery rate: a level not seen
      again in time within the window (by default ten round trips, ten targets) no longer
      holds the bound up, and a quiet spell or a lower load leaves the floor at what the
      recent traffic showed, not at what an earlier peak did.

    A request the decode replica shed (its own queue predicted past the SLO) is the same
    signal as a late first token (TCP's loss beside its delay): the door, not the replica,
    should be turning that traffic away, at once; but only down to ``sustained``, since one
    replica's queue (while another may have room, or on a prediction just over its
    threshold) does not show the path missing the SLO at what it served in time.

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
        sustained_window_s: float | None = None,
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
        window_s = 10 * target_s if sustained_window_s is None else sustained_window_s
        if window_s <= 0:
            raise ValueError(f"sustained_window_s must be > 0, got {sustained_window_s}")
        self.target_s, self.lag_budget_s, self.low, self.high = target_s, lag_budget_s, low, high
        self.decrease, self.batch_share = decrease, batch_share
        self.sustained_window_s = window_s
        self.limit = float(min(high, max(low, initial)))
        self.slow_start = True
        # (when, level) of in-time first tokens within the window, levels strictly
        # decreasing: the front is the window's maximum (a monotonic queue).
        self._in_time: deque[tuple[float, int]] = deque()
        self._cut_at = float("-inf")

    @property
    def sustained(self) -> int:
        """The most streams open at the admission of a request answered in time, within
        the window as of the last time passed in (0: none)."""
        return self._in_time[0][1] if self._in_time else 0

    def _expire(self, now: float) -> None:
        while self._in_time and now - self._in_time[0][0] > self.sustained_window_s:
            self._in_time.popleft()

    def _record_in_time(self, level: int, now: float) -> None:
        while self._in_time and self._in_time[-1][1] <= level:
            self._in_time.pop()
        self._in_time.append((now, level))

    def _cap_sustained(self, level: int) -> None:
        """A late first token showed ``level`` streams missing the target: no sample above
        it is evidence any more."""
        capped = [(t, min(v, level)) for t, v in self._in_time]
        self._in_time.clear()
        for t, v in capped:  # keep the strictly decreasing order
            self._record_in_time(v, t)

    def admits(self, priority: Priority, num_open: int) -> bool:
        """Whether one more stream of this class fits beside the ``num_open`` ones."""
        return num_open < self.bound(priority)

    def bound(self, priority: Priority) -> float:
        """A stream of this class fits while fewer than this many are open."""
        bound = self.limit if priority == "interactive" else self.batch_share * self.limit
        return max(self.low, bound)

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
        self._expire(now)
        late_s = max(self.target_s, predicted_s + self.target_s / 2)
        fast_s = max(self.target_s / 2, predicted_s + self.target_s / 4)
        if ttft_s > late_s:
            # Admitted alone, it waited behind none of this door's streams: hold.
            if open_at_admission > 0:
                self._cut(admitted_at, open_at_admission, now)
                self._cap_sustained(int(self.limit))
            self.slow_start = False
            return
        self._record_in_time(open_at_admission + 1, now)
        if ttft_s > fast_s or loop_lag_s > self.lag_budget_s / 2:
            self.slow_start = False
        elif open_at_admission + 2 >= self.limit:
            step = 1.0 if self.slow_start else 1.0 / self.limit
            self.limit = min(float(self.high), self.limit + step)

    def check_loop(self, loop_lag_s: float, num_open: int, now: float) -> None:
        """The loop's lag, while the door turns a request away (its 429 waits in that
        loop): past the budget, cut without waiting for a first token (a flood's onset
        lags the loop before any stream it admitted has one), at most every quarter of the
        target, the time the streams open then take to give way; never below
        ``sustained``."""
        self._expire(now)
        if loop_lag_s > self.lag_budget_s and now - self._cut_at >= self.target_s / 4:
            self._cut_to(num_open, now, floor=self.sustained)

    def refused(self, admitted_at: float, open_at_admission: int, now: float) -> None:
        """The decode replica shed a request this door let through: cut, as for a late
        first token, but never below ``sustained``."""
        self._expire(now)
        self._cut(admitted_at, open_at_admission, now, floor=self.sustained)

    def _cut(self, admitted_at: float, open_at_admission: int, now: float, floor: int = 0) -> None:
        self.slow_start = False
        if admitted_at > self._cut_at:  # once per round trip
            self._cut_to(open_at_admission + 1, now, floor)

    def _cut_to(self, num_open: int, now: float, floor: int = 0) -> None:
        """``decrease`` x the streams in use, at most a halving, never below ``low`` nor
        ``floor`` (nor above the bound it cuts)."""
        self.slow_start = False
        in_use = min(self.limit, num_open)
        cut = max(float(self.low), self.decrease * in_use, self.limit / 2)
        self.limit = max(cut, min(float(floor), self.limit))
        self._cut_at = now


def drain_s(mean_stream_s: float, num_open: int) -> float:
    """When a slot is expected to free: streams end every ``mean_stream_s / num_open``."""
    if num_open <= 0 or mean_stream_s <= 0:
        return MIN_DRAIN_S
    return max(MIN_DRAIN_S, mean_stream_s / num_open)
