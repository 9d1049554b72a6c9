"""What many test modules share: waiting on observable state with a deadline, and free ports.

Tests never sleep to synchronize: they wait here until the state they need is there (or fail
with a message naming what they waited for), so a slow machine makes them slower, never
wrong. Ports come from the OS through pdserve's own ``cluster.ports``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pdserve.cluster import ports

T = TypeVar("T")

LOOPBACK = "127.0.0.1"


def _describe(predicate: Callable[[], object], what: str | None) -> str:
    return what or getattr(predicate, "__qualname__", None) or repr(predicate)


def wait_until(
    predicate: Callable[[], T], timeout: float, interval: float = 0.02, what: str | None = None
) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something truthy, and
    return that; past ``timeout`` seconds raise ``TimeoutError`` naming ``what`` (default:
    the predicate's name) and the last value seen."""
    if timeout <= 0 or interval <= 0:
        raise ValueError(f"timeout and interval must be > 0, got {timeout} and {interval}")
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"waited {timeout:g} s for {_describe(predicate, what)}; last value {value!r}"
            )
        time.sleep(interval)


async def async_wait_until(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float,
    interval: float = 0.02,
    what: str | None = None,
) -> T:
    """``wait_until`` for code on an event loop: the predicate may be a coroutine function
    (its result is awaited), and the wait between calls is an ``asyncio.sleep``, so the
    loop keeps serving what the predicate waits for."""
    if timeout <= 0 or interval <= 0:
        raise ValueError(f"timeout and interval must be > 0, got {timeout} and {interval}")
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"waited {timeout:g} s for {_describe(predicate, what)}; last value {value!r}"
            )
        await asyncio.sleep(interval)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port the OS just handed out on ``host`` (``pdserve.cluster.ports.free_port``)."""
    return ports.free_port(host)


__all__ = ["LOOPBACK", "async_wait_until", "free_port", "wait_until"]
