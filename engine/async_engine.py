"""Asyncio front of LLMEngine for servers (Ray Serve replicas).

The LLMEngine is driven by one dedicated thread, so a step (tens of milliseconds of model
compute) never blocks the event loop. Every call that touches the engine is a command run
on that thread between steps, so the engine is never used from two threads at once. Outputs
go back to each request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``.

Before its first step the engine thread runs the device runtime's thread-start hook
(``engine.runtime``, owned by the model runner; on CPU it may bind the thread to its
CPUs): the event loop and every other thread of the process are left as they were.

A consumer that stops iterating (client disconnect, task cancellation) aborts its request,
which frees its KV blocks. If a step raises, every stream gets the error and later calls
raise ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pdserve.engine.kv_events import KVEvents
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput, TokenLogprob, merge_outputs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stats import EngineStats

if TYPE_CHECKING:
    import torch

    from pdserve.kernels.ops import RuntimeInfo

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How long the engine thread sleeps waiting for a command when there is nothing to step,
# and how often it retries while only KV sends are in flight or the queue is blocked.
_IDLE_WAIT_S = 0.5
_POLL_S = 0.002


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error (or was shut down)."""


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the consumer's event loop is closed
            return False


class AsyncLLMEngine:
    """Owns an LLMEngine and the thread that steps it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._started = threading.Event()  # set once the thread ran the runtime's start hook
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # touched only on the engine thread
        self._stats = engine.stats()
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> AsyncLLMEngine:
        return cls(LLMEngine.from_pretrained(model_dir, **kwargs))

    # ------------------------------------------------------------------ public API
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    def describe_runtime(self) -> RuntimeInfo:
        """The device runtime's report, once the engine thread started (for reports)."""
        self._started.wait(5.0)
        return self.engine.runtime.describe()

    def dtypes(self) -> tuple[str, str]:
        """(weights, KV cache) dtypes of the engine (``LLMEngine.dtypes``)."""
        return self.engine.dtypes()

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step or command (never blocks)."""
        return self._stats

    @property
    def kv_cache(self) -> torch.Tensor:
        """The KV pool ``[L, P, N, B, Hkv, D]``, allocated once with the engine: for a KV
        receiver to export it and write reserved blocks. Never read it on the event loop."""
        return self.engine.kv_cache

    @property
    def window_kv_cache(self) -> torch.Tensor | None:
        """The window layers' own pool, where the engine keeps one (``LLMEngine``)."""
        return self.engine.window_kv_cache

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.engine.block_size

    def drain_kv_events(self) -> KVEvents:
        """The prefix cache's stored/evicted block hashes since the last call, the window
        pool's too where there is one (never waits for the engine thread: the logs have
        their own locks)."""
        return self.engine.drain_kv_events()

    def cached_block_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now, for a KV-event snapshot. Read off
        the engine thread on purpose, like ``cached_prefix_tokens``: copying a dict's keys
        is one step under the GIL, and a slightly stale set only skews routing."""
        return self.engine.kv_cache_manager.pool.cached_hashes()

    def cached_window_block_hashes(self) -> list[int]:
        """The same for the window pool (empty without one)."""
        window = self.engine.kv_cache_manager.window
        return window.pool.cached_hashes() if window is not None else []

    @property
    def kv_window(self) -> int:
        """The window (tokens) whose KV the window pool keeps per sequence; 0 without one."""
        window = self.engine.kv_cache_manager.window
        return window.window if window is not None else 0

    @property
    def window_hit_blocks(self) -> int:
        """How many of a prefix hit's last blocks the window pool must hold for the hit to
        be usable (``WindowKV.hit_blocks``); 0 without a window pool."""
        window = self.engine.kv_cache_manager.window
        return window.hit_blocks if window is not None else 0

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens whose KV the prefix cache holds right now (full blocks; the last
        token is always computed, so it never counts).

        Unlike the commands it does not wait for the engine thread, on purpose: placement
        asks before every request and must not wait out a step. It only looks hashes up (a
        dict read the GIL keeps whole); a stale answer makes the placement heuristic
        slightly off, never the output wrong (the scheduler looks up again on admission).
        """
        return self.engine.cached_prefix_tokens(token_ids)

    async def check_integrity(self) -> None:
        """Check queues, request states and block ref counts between steps (on the engine
        thread, which owns them); raises AssertionError if they disagree."""
        await self._call(self.engine.check_integrity)

    def check_health(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop stopped: {self._error!r}") from self._error
        if self._stopped.is_set():
            raise EngineDeadError("engine was shut down")
        alive = getattr(self.engine, "check_health", None)
        if alive is not None:  # e.g. a tensor-parallel rank died between steps
            try:
                alive()
            except Exception as exc:
                raise EngineDeadError(f"engine cannot compute: {exc}") from exc

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
        arrival_time: float | None = None,
        on_added: Callable[[], None] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs until it finishes.

        Bad input raises ValueError before anything is yielded. Leaving the loop early or
        cancelling the consuming task aborts the request. ``on_added`` runs (on the event
        loop) once the engine holds the request, ``stats()`` already counting it.
        """
        stream = self._new_stream()

        def add() -> None:
            self.engine.add_request(
                request_id, prompt, params, prefill_only=prefill_only, arrival_time=arrival_time
            )
            self._streams[request_id] = stream

        try:
            await self._call(add)
        except asyncio.CancelledError:
            self._abort_soon(request_id, stream)
            raise
        if on_added is not None:
            on_added()
        async for output in self._consume(request_id, stream):
            yield output

    async def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends with finish_reason "abort"); frees its blocks."""
        await self._call(lambda: self._abort(request_id, None))

    async def reserve_remote_prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        receives_window_pool: bool = False,
    ) -> list[int] | None:
        """Decode role: reserve blocks (None if no room). Read its outputs with stream().
        ``receives_window_pool``: as ``LLMEngine.reserve_remote_prefill``."""
        stream = self._new_stream()

        def reserve() -> list[int] | None:
            blocks = self.engine.reserve_remote_prefill(
                request_id,
                prompt_token_ids,
                params,
                arrival_time=arrival_time,
                receives_window_pool=receives_window_pool,
            )
            if blocks is not None:
                self._streams[request_id] = stream
            return blocks

        return await self._call(reserve)

    async def remote_window_blocks(self, request_id: str) -> tuple[int, list[int]]:
        """A reserved remote prefill's window pool blocks (``LLMEngine.remote_window_blocks``)."""
        return await self._call(lambda: self.engine.remote_window_blocks(request_id))

    async def complete_remote_prefill(
        self,
        request_id: str,
        first_token_id: int,
        first_logprobs: TokenLogprob | None = None,
        *,
        num_cached_tokens: int | None = None,
    ) -> None:
        await self._call(
            lambda: self.engine.complete_remote_prefill(
                request_id, first_token_id, first_logprobs, num_cached_tokens=num_cached_tokens
            )
        )

    async def fail_remote_prefill(self, request_id: str) -> None:
        await self._call(lambda: self.engine.fail_remote_prefill(request_id))

    async def stream(
        self, request_id: str, *, abort_on_exit: bool = True
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of a request reserved with reserve_remote_prefill (one consumer).

        With ``abort_on_exit=False`` leaving early does not abort: the caller first fences
        the peer that may still write into the reserved blocks, then calls ``abort()``.
        """
        stream = await self._call(lambda: self._streams.get(request_id))
        if stream is None:
            raise ValueError(f"request_id {request_id!r} has no open stream")
        async for output in self._consume(request_id, stream, abort_on_exit=abort_on_exit):
            yield output

    def worker_places(self) -> list[Any]:
        """Where the engine's other tensor-parallel ranks run ([] for one device)."""
        return self.engine.worker_places()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; open streams end with EngineDeadError."""
        self._stopped.set()
        self._commands.put(lambda: None)  # wake the thread
        self._thread.join(timeout)
        self._fail_all(EngineDeadError("engine was shut down"))
        release = getattr(self.engine, "shutdown", None)
        if release is not None and not self._thread.is_alive():  # else a step still runs
            release()

    # ------------------------------------------------------------------ event-loop side
    def _new_stream(self) -> _Stream:
        self.check_health()
        return _Stream(asyncio.get_running_loop(), asyncio.Queue())

    async def _consume(
        self, request_id: str, stream: _Stream, *, abort_on_exit: bool = True
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        error: BaseException | None = None
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                # Outputs that piled up while the consumer was busy go out as one (an error
                # behind them is raised after they are delivered).
                while not item.finished and not stream.queue.empty():
                    later = stream.queue.get_nowait()
                    if isinstance(later, BaseException):
                        error = later
                        break
                    item = merge_outputs(item, later)
                finished = item.finished or error is not None
                yield item
                if error is not None:
                    raise error
                if finished:
                    return
        finally:
            if not finished and abort_on_exit:
                self._abort_soon(request_id, stream)

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between steps and return its result."""
        self.check_health()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            if self._error is not None or self._stopped.is_set():
                future.set_exception(EngineDeadError("engine loop is not running"))
                return
            try:
                result = fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                self._stats = self.engine.stats()  # callers may read stats() right after
                future.set_result(result)

        self._commands.put(command)
        if self._error is not None or self._stopped.is_set():
            self._drain_commands()  # the thread may be gone: fail what it will never run
        return await asyncio.wrap_future(future)

    def _abort_soon(self, request_id: str, stream: _Stream) -> None:
        """Abort from a finally block without awaiting (thread-safe, fire and forget)."""
        if self._error is None and not self._stopped.is_set():
            self._commands.put(lambda: self._abort(request_id, stream))

    # ------------------------------------------------------------------ engine thread
    def _abort(self, request_id: str, owner: _Stream | None) -> None:
        stream = self._streams.get(request_id)
        if owner is not None and stream is not owner:
            return  # the id now belongs to someone else (or never became ours)
        output = self.engine.abort(request_id)
        if output is not None:
            self._publish([output])
        elif stream is not None and owner is not None:
            del self._streams[request_id]

    def _run(self) -> None:
        try:
            self.engine.runtime.on_engine_thread_start()
        finally:
            self._started.set()
        blocked = False  # the last step could schedule nothing: don't spin on it
        try:
            while not self._stopped.is_set():
                if self.engine.has_ready_work() and not blocked:
                    self._run_commands(wait=0.0)
                elif self.engine.has_pending_work():
                    self._run_commands(wait=_POLL_S)
                else:
                    self._run_commands(wait=_IDLE_WAIT_S)
                if self._stopped.is_set():
                    break
                if self.engine.has_pending_work():
                    outputs = self.engine.step()
                    blocked = not outputs and self.engine.last_step_num_tokens == 0
                    self._stats = self.engine.stats()  # before consumers see the outputs
                    self._publish(outputs)
        except BaseException as exc:  # a broken engine must not hang its clients
            logger.exception("engine loop died")
            self._error = exc
            self._fail_all(EngineDeadError(f"engine loop stopped: {exc!r}"))

    def _run_commands(self, wait: float) -> None:
        """Run queued commands, waiting up to ``wait`` seconds for the first one."""
        try:
            command = self._commands.get(timeout=wait) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()  # _call commands catch their own errors; aborts must not fail
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._stats = self.engine.stats()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            if not stream.put(output) and not output.finished:
                del self._streams[output.request_id]
                self.engine.abort(output.request_id)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put(error)
        self._streams.clear()
        self._drain_commands()

    def _drain_commands(self) -> None:
        """Once the loop is dead: queued commands fail their callers with EngineDeadError."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:
                logger.exception("command failed after the engine loop stopped")
