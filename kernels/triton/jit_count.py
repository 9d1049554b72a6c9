"""Count Triton compilations (new in-process specialisations) while something runs.

A serving replica must not JIT: every kernel variant is compiled during warm-up, and a
compilation after it is a latency spike of tens to hundreds of milliseconds on the step
that hit it. ``CompileCounter`` chains into Triton's ``jit_cache_hook`` (called on each
in-memory cache miss, before the disk cache or the compiler) and records the kernel's
name. Under ``TRITON_INTERPRET=1`` nothing is compiled and nothing is counted.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class CompileCounter:
    """``with CompileCounter() as c: ...``; then ``c.total`` and ``c.by_kernel``."""

    def __init__(self) -> None:
        self.by_kernel: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._previous: Any = None

    @property
    def total(self) -> int:
        return sum(self.by_kernel.values())

    def _hook(self, *, fn: Any, **kwargs: Any) -> bool:
        with self._lock:
            self.by_kernel[getattr(fn, "name", str(fn))] += 1
        previous = self._previous
        # Returning True would tell Triton to skip the compilation: defer to a chained hook.
        return bool(previous(fn=fn, **kwargs)) if previous is not None else False

    def __enter__(self) -> CompileCounter:
        from triton import knobs

        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._previous
