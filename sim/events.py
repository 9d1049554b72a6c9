"""The discrete-event loop: a clock and a heap of timed callbacks.

Events at the same time run in the order they were scheduled (a sequence number breaks
ties), so a simulation is deterministic for a given seed. Callbacks may schedule more
events and cancel pending ones; nothing here knows about replicas or requests.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class Event:
    """A scheduled callback; ``cancel()`` makes the loop skip it."""

    __slots__ = ("time", "fn", "args", "cancelled")

    def __init__(self, time: float, fn: Callable[..., Any], args: tuple[Any, ...]):
        self.time, self.fn, self.args = time, fn, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    """Simulated time in seconds, starting at 0."""

    def __init__(self) -> None:
        self.now = 0.0
        # (time, sequence number, event): tuples compare in C, and never reach the event.
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = 0
        self.num_processed = 0

    def at(self, time: float, fn: Callable[..., Any], *args: Any) -> Event:
        """Run ``fn(*args)`` at ``time`` (never before now)."""
        if time < self.now:
            raise ValueError(f"cannot schedule at {time} before now ({self.now})")
        self._seq += 1
        event = Event(time, fn, args)
        heapq.heappush(self._heap, (time, self._seq, event))
        return event

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> Event:
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        # ``at`` inlined: this is the simulator's most frequent call.
        time = self.now + delay
        self._seq += 1
        event = Event(time, fn, args)
        heapq.heappush(self._heap, (time, self._seq, event))
        return event

    def pending(self) -> int:
        return sum(1 for _, _, e in self._heap if not e.cancelled)

    def run_while(self, condition: Callable[[], bool]) -> None:
        """Process events in time order while ``condition()`` holds and events are left (the
        clock stays at the last one processed)."""
        heap = self._heap
        while heap and condition():
            time, _, event = heapq.heappop(heap)
            if event.cancelled:
                continue
            self.now = time
            self.num_processed += 1
            event.fn(*event.args)

    def run(self, until: float | None = None) -> None:
        """Process events in time order until none is left (or the next is past ``until``,
        where the clock then stops)."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            time, _, event = pop(heap)
            if event.cancelled:
                continue
            self.now = time
            self.num_processed += 1
            event.fn(*event.args)
        if until is not None:
            self.now = max(self.now, until)
