"""Process bookkeeping by pid: who belongs to a session we started, and stopping them.

Every node is started as ``ray start --block`` in a new session (``setsid``), so the node's
GCS, raylet, dashboard, agents and workers all carry that session id. ``down`` finds them by
that id in ``/proc`` and signals them by pid: never ``ray stop`` (it kills every Ray process
on the machine) and never by process name. Zombies count as gone: they run nothing and only
their parent can reap them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0], session is [3])."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def session_members(session_ids: Iterable[int]) -> list[int]:
    """Running (non-zombie) pids whose session id is one of ``session_ids``."""
    wanted = set(session_ids)
    members = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[3]) in wanted:
            members.append(int(entry.name))
    return sorted(members)


def child_session_leaders(parent: int | None = None) -> list[int]:
    """Running children of ``parent`` (default: this process) that lead a session of their own:
    the nodes this process started, whether or not they made it into the state file."""
    parent = os.getpid() if parent is None else parent
    leaders = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        # After the command name: state [0], ppid [1], pgrp [2], session [3].
        if (
            fields is not None
            and fields[0] not in ("Z", "X")
            and int(fields[1]) == parent
            and int(fields[3]) == int(entry.name)
        ):
            leaders.append(int(entry.name))
    return sorted(leaders)


def _signal(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _reap(pids: Iterable[int]) -> None:
    """Collect those of ``pids`` that are exited children of this process.

    ``pdserve run`` is the parent of the ``ray start`` processes; anyone else gets
    ``ChildProcessError`` and leaves the reaping to the processes' real parent.
    """
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def wait_gone(session_ids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until no session member runs; returns the survivors (empty when all are gone)."""
    sessions = list(session_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        _reap(sessions)
        left = session_members(sessions)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def stop_sessions(leaders: list[int], grace_s: float = 10.0) -> list[int]:
    """Stop every process of the sessions led by ``leaders``; returns pids that survived.

    SIGTERM goes to the leaders only: ``ray start --block`` then shuts its node down in order
    (raylet and workers, then GCS and dashboard). Whatever is still running after ``grace_s``
    gets SIGKILL by pid.
    """
    _signal([p for p in leaders if p in session_members(leaders)], signal.SIGTERM)
    left = wait_gone(leaders, grace_s)
    if left:
        _signal(left, signal.SIGKILL)
        left = wait_gone(leaders, 5.0)
    return left
