"""A deployment handle's first use, paid while its replica starts instead of by the first
requests: Serve's router is built on a handle's first call, waits for the replica list and
probes queue lengths, and Ray connects to the replica's actor; under a burst that first
call is what every admitted request waits behind (docs/tuning.md)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

WARMUP_TIMEOUT_S = 300.0  # the pool it calls may still be loading its model


async def warm_up(call: Callable[[], Awaitable[object]], what: str, timeout_s: float) -> bool:
    """Run ``call`` (a cheap method of the deployment, through its handle) once; False,
    logged, when it fails or takes past ``timeout_s``: the first request pays instead."""
    try:
        await asyncio.wait_for(call(), timeout_s)
    except Exception as err:  # noqa: BLE001 - a missed warm-up only costs latency
        logger.warning("warming the %s handle failed: %r", what, err)
        return False
    return True


def start_warm_up(
    call: Callable[[], Awaitable[object]],
    what: str,
    tasks: set[asyncio.Task[bool]],
    timeout_s: float = WARMUP_TIMEOUT_S,
) -> bool:
    """``warm_up`` in the background on the running loop (Serve runs a replica's
    constructor there), kept in ``tasks`` until done, in a fresh context: no request's
    Serve id goes with the call. False when no loop runs (nothing started)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        logger.info("no event loop: the %s handle is not warmed", what)
        return False
    task = contextvars.Context().run(loop.create_task, warm_up(call, what, timeout_s))
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return True
