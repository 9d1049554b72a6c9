"""The `pdserve` command line as a user runs it: a command that returns (`status`, `down`),
or `pdserve run` in the background with its output read line by line as it prints it."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "pdserve.cluster.cli"]


def pdserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`pdserve ARGS` from the repository root, its output captured."""
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


class PdserveRun:
    """`pdserve run CONFIG --state-dir STATE_DIR ARGS` in the background; ``log`` holds the
    lines read so far (stderr merged into stdout).

    ``new_session``: the command leads a process group of its own, as under systemd or
    Docker, so a test can signal the whole group."""

    def __init__(
        self,
        config: Path,
        state_dir: Path,
        *args: str,
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
    ) -> None:
        self.proc = subprocess.Popen(
            [*CLI, "run", str(config), "--state-dir", str(state_dir), *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(env) if env is not None else None,
            start_new_session=new_session,
        )
        self.log: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()  # None: the output closed
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def output(self) -> str:
        return "\n".join(self.log)

    def wait_for(self, pattern: str, timeout: float) -> str:
        """Read lines until one matches the regular expression ``pattern``; return the
        match's first group (the whole match when it has none). AssertionError with the
        output so far when the command exits first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"pdserve run exited before {pattern!r}:\n{self.output()}")
            self.log.append(line)
            if match := re.search(pattern, line):
                return match.group(1) if match.re.groups else match.group(0)
        raise AssertionError(f"no {pattern!r} after {timeout} s:\n{self.output()}")

    def drain(self, timeout: float = 30) -> None:
        """Read the rest of the output, up to its end (call once the command has exited)."""
        while (line := self._lines.get(timeout=timeout)) is not None:
            self.log.append(line)

    def kill(self) -> bool:
        """Kill the command if it still runs, and reap it; whether it was still running."""
        if self.proc.poll() is not None:
            return False
        self.proc.kill()
        self.proc.wait()
        return True
