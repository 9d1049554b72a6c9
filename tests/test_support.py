"""The test-support kit itself: waiting on state with a deadline, and free ports."""

from __future__ import annotations

import asyncio
import itertools
import socket

import pytest

from tests.support import async_wait_until, free_port, wait_until


def test_wait_until_returns_the_first_truthy_value() -> None:
    calls = itertools.count()
    assert wait_until(lambda: next(calls) >= 3 and "ready", timeout=5, interval=0.001) == "ready"


def test_wait_until_names_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError, match=r"waited 0.05 s for the replica to drain; last value 0"):
        wait_until(lambda: 0, timeout=0.05, interval=0.01, what="the replica to drain")


def test_wait_until_refuses_a_deadline_in_the_past() -> None:
    with pytest.raises(ValueError, match="timeout and interval must be > 0, got 0"):
        wait_until(lambda: True, timeout=0)


def test_async_wait_until_awaits_coroutine_predicates() -> None:
    calls = itertools.count()

    async def ready() -> bool:
        return next(calls) >= 2

    assert asyncio.run(async_wait_until(ready, timeout=5, interval=0.001)) is True
    with pytest.raises(TimeoutError, match="never"):
        asyncio.run(async_wait_until(lambda: None, timeout=0.05, interval=0.01, what="never"))


def test_free_port_can_be_bound_on_loopback() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
