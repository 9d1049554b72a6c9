"""The CPU runtime: threads, pinning, OpenMP teams, niceness and the allocator of a CPU engine.

Everything that tunes how a CPU engine process computes lives here, behind a few hooks the
engine calls without knowing what they do (``CpuRuntime``: ``prepare_process`` when the
model runner starts, ``on_engine_thread_start`` on the engine's step thread,
``before_step`` before each forward pass, ``describe`` for reports), plus
``single_threaded_copies`` for threads that copy tensors beside the engine (kvtransfer's
I/O threads). The model runner owns the runtime; ``pdserve.kernels.ops`` creates it.

Why each piece exists:
- pinning: on a CPU-only node the engine's step thread (and the OpenMP workers torch starts
  from it) should own its cores: when the serving threads around it (Ray's workers, the
  proxy, the ingress) are scheduled onto the same cores, every step waits behind their
  short bursts and an OpenMP barrier waits for its slowest thread. vLLM's CPU backend does
  the same with ``VLLM_CPU_OMP_THREADS_BIND``. Linux only (``os.sched_setaffinity``);
  elsewhere binding is a logged no-op.
- helper threads: a bound engine can add OpenMP threads on the process's other (shared)
  CPUs, niced, for big steps only, so a small node's serving CPUs put their idle time into
  prefill.
- niceness: where pools share CPUs, a niced prefill replica lets decode steps win them; a
  niced engine thread (``engine_nice``) lets the serving threads of its node (Serve's proxy,
  the ingress, its own replica's event loop) run first, so they answer under overload.
- allocator: glibc hands freed activation memory back to the OS (see ``keep_freed_memory``).

It never changes what is computed, only where and on how many threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import threading
from collections.abc import Collection
from dataclasses import dataclass

import torch

from pdserve.kernels.cpu import native
from pdserve.kernels.cpu.cpus import (
    RuntimeInfo,
    RuntimeSettings,
    current_thread_cpus,
    format_cpu_list,
)

logger = logging.getLogger(__name__)

# Niceness of helper threads: a serving thread of the shared CPUs that wakes up preempts
# them at once, so they use only the time those CPUs would otherwise idle.
HELPER_NICE = 10


# ---- threads and CPUs -------------------------------------------------------------------


def bind_current_thread(cpus: Collection[int]) -> bool:
    """Restrict the calling thread (only it, and threads it starts later) to ``cpus``.

    Returns whether it was bound; failures (another OS, a cgroup that excludes the CPUs)
    are logged, never raised: an unbound engine is slower, not wrong.
    """
    if not cpus:
        return False
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("CPU binding is not supported on this OS; engine threads stay unbound")
        return False
    try:
        os.sched_setaffinity(0, set(cpus))  # 0 = the calling thread on Linux
    except OSError as err:
        logger.warning(
            "could not bind the engine thread to CPUs %s: %s", format_cpu_list(cpus), err
        )
        return False
    logger.info("engine thread bound to CPUs %s", format_cpu_list(cpus))
    return True


def set_torch_threads(num_cpus: float, bound_cpus: tuple[int, ...] = ()) -> int:
    """Give torch as many intra-op threads as the replica has CPUs (at least one, and no
    more than the CPUs its engine is bound to): unpinned replicas on a small machine would
    otherwise oversubscribe each other."""
    threads = max(1, int(num_cpus))
    if bound_cpus:
        threads = min(threads, len(bound_cpus))
    torch.set_num_threads(threads)
    return threads


def limit_threads_to_process_cpus() -> None:
    """Don't run more intra-op threads than CPUs this process may use.

    Deployments set the thread count to their CPU share (Ray also exports OMP_NUM_THREADS to
    its workers); this only lowers torch's default, when nobody chose a count and the
    process is pinned to fewer CPUs than the machine has.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return
    if torch.get_num_threads() > allowed:
        torch.set_num_threads(allowed)


def lower_cpu_priority(nice: int) -> int:
    """Raise every thread of this process to at least niceness ``nice``; returns how many
    threads were changed.

    On Linux niceness is per thread and a new thread inherits its creator's, so this covers
    the threads that exist now and, through them, the engine and OpenMP threads started
    later. Only ever lowers priority (which needs no privileges).
    """
    if nice <= 0:
        return 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the whole process
        tids = [0]
    changed = 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:  # the thread ended meanwhile
            continue
    return changed


def lower_thread_priority(nice: int) -> bool:
    """Raise the calling thread (only it, and the threads it starts later, which inherit
    it) to at least niceness ``nice``; returns whether it changed. Linux only (elsewhere
    niceness is per process and this is a logged no-op); only ever lowers priority."""
    if nice <= 0:
        return False
    if not sys.platform.startswith("linux"):
        logger.warning("per-thread niceness is not supported on this OS; engine not niced")
        return False
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) >= nice:
            return False
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as err:
        logger.warning("could not nice the engine thread to %d: %s", nice, err)
        return False
    return True


@dataclass
class StepThreads:
    """Intra-op threads per engine step: ``base`` (the bound CPUs' threads) for small
    steps, ``total`` (with the helpers on the shared CPUs) for steps of at least
    ``min_tokens`` tokens, where compute, not memory, sets the step's time."""

    base: int
    total: int
    min_tokens: int

    def apply(self, num_tokens: int) -> int:
        want = self.total if num_tokens >= self.min_tokens else self.base
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        return want


# ---- OpenMP teams of threads other than the engine's ----------------------------------


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (GNU libgomp), if any."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def single_threaded_copies() -> bool:
    """Make tensor ops started from the calling thread run on it alone (no OpenMP team).

    ATen runs a large CPU copy as an OpenMP parallel region on a team of
    ``get_num_threads()`` threads. An I/O thread that opens its own team while the engine's
    model thread runs another oversubscribes the cores: the copy then waits for its slowest
    team member to be scheduled, so a sub-millisecond copy takes tens of milliseconds on a
    busy host (docs/cpu.md). A block copy is bound by memory bandwidth, which
    one core nearly saturates. The OpenMP thread count is a per-thread setting (ICV): this
    changes only the calling thread, not the engine's. Returns whether it took effect.
    """
    # ATen initialises each thread's OpenMP thread count lazily, on its first query, from
    # the process-wide setting; trigger that first so it cannot undo ours.
    torch.get_num_threads()
    lib = _libgomp()
    if lib is None:
        return False
    lib.omp_set_num_threads(1)
    if torch.get_num_threads() != 1:  # pragma: no cover - another OpenMP runtime
        logger.debug("could not limit this thread's OpenMP team")
        return False
    return True


# ---- the allocator ------------------------------------------------------------------------

# Keep freed activation memory in the process heap (glibc ``mallopt``). By default glibc
# serves every allocation above 128 KiB-32 MiB with a fresh ``mmap`` and hands it back on
# ``free``. A CPU forward pass allocates and frees megabytes of activations per layer, so
# each step page-faults the same memory in again, at prefill sizes costing more than the
# RMSNorm it feeds (docs/cpu.md). Raising
# the mmap and trim thresholds makes freed blocks reusable, which is what GPU caching
# allocators do and what vLLM gets on CPU by preloading tcmalloc. The heap keeps its peak.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# glibc refuses mmap thresholds above HEAP_MAX/2 (32 MiB on 64-bit): the largest step
# activation of the models we serve on CPU ([2048 tokens, 5120] bf16) is under it.
MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30
_TOP_PAD = 64 << 20

_malloc_tuned = False


def keep_freed_memory() -> bool:
    """Tune glibc malloc once per process; False where that is not possible (not glibc)."""
    global _malloc_tuned
    if _malloc_tuned:
        return True
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl, macOS: no mallopt
        return False
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
            (_M_TOP_PAD, _TOP_PAD),
        )
    )
    if not ok:
        logger.warning("mallopt refused a setting; CPU steps may page-fault their activations")
    _malloc_tuned = ok
    return ok


# ---- the runtime the model runner owns ----------------------------------------------------


class CpuRuntime:
    """A CPU engine's runtime, from its replica's ``RuntimeSettings``.

    Side effects, by hook: ``prepare_process`` sets torch's thread count, the niceness of
    every thread of the process and glibc's malloc thresholds, and builds the native
    kernels; ``on_engine_thread_start`` nices the calling thread (``engine_nice``) and
    binds it (and helper OpenMP threads) to CPUs; ``before_step`` sets the thread count for
    the step's size. The engine CPUs are resolved at construction, so a bad CPU list fails
    before the model loads.
    """

    def __init__(self, settings: RuntimeSettings | None = None) -> None:
        self.settings = settings or RuntimeSettings()
        self._engine_cpus = self.settings.engine_cpus()
        self._info = RuntimeInfo()
        # Threads per step by its size; set once helper threads started.
        self.step_threads: StepThreads | None = None

    def prepare_process(self) -> None:
        s = self.settings
        if s.num_cpus is not None:
            set_torch_threads(s.num_cpus, self._engine_cpus)
        lower_cpu_priority(s.nice)
        limit_threads_to_process_cpus()
        keep_freed_memory()
        native.available()  # build the CPU kernels now, not in the first request

    def on_engine_thread_start(self) -> None:
        # Before any OpenMP team exists: the team's threads inherit the step thread's
        # niceness (helpers are niced further in _start_helpers).
        lower_thread_priority(self.settings.engine_nice)
        process_cpus = current_thread_cpus()  # inherited: the process's (shared) CPUs
        if self._engine_cpus and bind_current_thread(self._engine_cpus):
            self._info = RuntimeInfo(engine_cpus=self._engine_cpus)
            if self.settings.helper_threads:
                self._start_helpers(process_cpus)

    def before_step(self, num_tokens: int) -> None:
        if self.step_threads is not None:
            self.step_threads.apply(num_tokens)

    def describe(self) -> RuntimeInfo:
        return self._info

    def _start_helpers(self, process_cpus: tuple[int, ...]) -> None:
        """Bind ``helper_threads`` OpenMP threads to the CPUs the engine thread gave up."""
        bound = self._engine_cpus
        helpers = self.settings.helper_threads
        shared = tuple(c for c in process_cpus if c not in bound)
        if not shared:
            logger.info("no CPUs outside the engine's for helper threads; none started")
            return
        base = max(1, min(torch.get_num_threads(), len(bound)))
        total = base + helpers
        torch.set_num_threads(base)
        sets = [bound] * base + [shared] * helpers
        if not native.bind_omp_team(sets, helper_nice=HELPER_NICE):
            logger.warning("could not bind helper threads (no native kernels?); none used")
            return
        self._info = RuntimeInfo(engine_cpus=bound, helper_cpus=shared)
        self.step_threads = StepThreads(base, total, self.settings.helper_min_tokens)
        logger.info(
            "%d helper thread(s) on CPUs %s for steps of >= %d tokens",
            helpers,
            ",".join(map(str, shared)),
            self.settings.helper_min_tokens,
        )
