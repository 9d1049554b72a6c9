"""The event loop: time order, FIFO among equal times, cancellation, stopping."""

from __future__ import annotations

import pytest

from pdserve.sim.events import EventLoop


def test_events_run_in_time_order_and_fifo_at_equal_times() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    loop.at(2.0, lambda: seen.append((loop.now, "c")))
    loop.at(1.0, lambda: seen.append((loop.now, "a")))
    loop.at(1.0, lambda: seen.append((loop.now, "b")))
    loop.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (2.0, "c")]


def test_callbacks_schedule_and_cancel_more_events() -> None:
    loop = EventLoop()
    seen: list[str] = []
    doomed = loop.at(5.0, seen.append, "never")

    def first() -> None:
        seen.append("first")
        loop.after(0.5, seen.append, "later")
        doomed.cancel()

    loop.at(1.0, first)
    loop.run()
    assert seen == ["first", "later"]
    assert loop.now == 1.5
    assert loop.num_processed == 2


def test_run_until_stops_the_clock_there() -> None:
    loop = EventLoop()
    seen: list[float] = []
    for t in (1.0, 2.0, 3.0):
        loop.at(t, seen.append, t)
    loop.run(until=2.5)
    assert seen == [1.0, 2.0]
    assert loop.now == 2.5
    assert loop.pending() == 1


def test_no_event_in_the_past() -> None:
    loop = EventLoop()
    loop.at(1.0, lambda: None)
    loop.run()
    with pytest.raises(ValueError, match="before now"):
        loop.at(0.5, lambda: None)
    with pytest.raises(ValueError, match="delay"):
        loop.after(-1.0, lambda: None)
