"""Ranks 1..tp-1 of a tensor-parallel engine, and how rank 0 reaches them.

``TPWorker`` holds a rank's shard of the model and of the KV pool and runs every step rank
0 sends it (``pdserve.engine.tp_executor``); beside it the serving layer may run a KV agent
(the rank's KV sender or receiver). Two transports carry rank 0's calls:

- ``mp``: a spawned child process with two pipes: the step channel (the engine thread's
  calls, in order) and a control channel (any thread; each call on its own thread in the
  worker). A worker exits when its pipes close, so nothing outlives rank 0;
- ``ray``: a threaded Ray actor in bundle ``rank`` of the caller's placement group (a Serve
  replica deployed with ``placement_group_bundles``); Ray ends it with the replica.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.parallel import TPShard, join_group
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.window_kv import WindowLayout

# How long a worker may take to start (load its shard, join the group) and a step to reply.
START_TIMEOUT_S = 600.0
GROUP_TIMEOUT_S = 300.0


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker failed or died; the replica cannot compute any more."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker rank needs to start (pickled to the child process / actor)."""

    config: EngineConfig
    rank: int
    store_address: tuple[str, int]
    runtime_settings: Any = None
    # Built in the worker (the objects themselves hold threads, sockets, shared memory).
    kv_cache_allocator_factory: Callable[[], Any] | None = None
    kv_agent_factory: KVAgentFactory | None = None
    group_timeout_s: float = GROUP_TIMEOUT_S


class RankKVAgent(Protocol):
    """What a worker rank runs beside its shard to move KV (built by the serving layer's
    ``KVAgentFactory`` once the rank's pool exists): on a prefill rank the worker half of
    a KV connector (the forward pass feeds it), on a decode rank a receiver; rank 0's
    ``TPConnector`` reaches it through the step (``apply_step_meta`` / ``step_report``)
    and through ``TPExecutor.agent_call``."""

    connector: KVConnector | None  # hooked into this rank's forward pass, if any

    def apply_step_meta(self, meta: Any) -> None:
        """What rank 0's connector sent along with the step (e.g. new KV targets)."""

    def step_report(self, finished: list[str]) -> Any:
        """What rank 0's connector gets back for the step (e.g. finished sends)."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class RankPool:
    """A worker rank's KV pool, as its KV agent is built from it."""

    kv_cache: torch.Tensor  # [L, 2, N, B, H, D]: the rank's heads
    model_name: str  # the model identity both ends of a hand-off compare
    shard: TPShard
    kv_heads: int  # KV heads of the whole model
    kv_scales: torch.Tensor | None = None  # an int8 / float8 pool's [L, 2, H] scales
    # The window layers' own pool [L_window, 2, N_w, B, H, D] (engine/window_kv.py), its
    # plan and scales; ``kv_cache`` and ``kv_scales`` then hold the other layers only.
    window_kv_cache: torch.Tensor | None = None
    window_layout: WindowLayout | None = None
    window_kv_scales: torch.Tensor | None = None


# A worker rank's pool -> the rank's agent
KVAgentFactory = Callable[[RankPool], RankKVAgent]


@dataclass(frozen=True)
class RankPlace:
    """Where a worker rank runs."""

    rank: int
    pid: int
    node_id: str | None  # Ray node id; None for a child process outside Ray


class TPWorker:
    """Rank r >= 1: its shard of the model and of the KV pool, stepped by rank 0."""

    def __init__(self, spec: WorkerSpec) -> None:
        from pdserve.engine.model_runner import ModelRunner, resolve_device

        config = spec.config
        device = resolve_device(config.device, spec.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = join_group(
            spec.rank,
            config.tensor_parallel_size,
            spec.store_address,
            device,
            spec.group_timeout_s,
        )
        allocator = spec.kv_cache_allocator_factory() if spec.kv_cache_allocator_factory else None
        self.agent_factory = spec.kv_agent_factory
        self.agent: RankKVAgent | None = None
        self.runner = ModelRunner(
            config, kv_cache_allocator=allocator, runtime_settings=spec.runtime_settings, tp=tp
        )

    def call(self, method: str, *args: Any) -> Any:
        """The one entry point of both transports: run ``method`` of this worker."""
        if method not in _WORKER_METHODS:
            raise ValueError(f"unknown worker method {method!r}")
        return getattr(self, method)(*args)

    def profile_num_blocks(self) -> int:
        return self.runner.profile_num_blocks()

    def allocate_kv_cache(self, num_blocks: int, model_name: str) -> WindowLayout | None:
        """Allocate this rank's pools; returns its window pool's plan (rank 0 checks that
        every rank planned the same)."""
        cache = self.runner.allocate_kv_cache(num_blocks)
        if self.agent_factory is not None:
            cfg = self.runner.model_config
            scales, window_scales = self.runner.pool_kv_scales()
            pool = RankPool(
                cache,
                model_name,
                self.runner.tp.shard,
                cfg.num_kv_heads,
                scales,
                self.runner.window_kv_cache,
                self.runner.window_layout,
                window_scales,
            )
            self.agent = self.agent_factory(pool)
            connector = self.agent.connector
            # As on rank 0: only a connector that reads KV per layer joins the forward pass.
            self.runner.kv_connector = (
                connector if connector is not None and connector.saves_kv_layers else None
            )
        return self.runner.window_layout

    def warm_up(self) -> int:
        return self.runner.warm_up()

    def kv_scales(self) -> torch.Tensor | None:
        """This rank's ``[L, 2, H]`` KV scales (on the CPU), None for a float pool."""
        scales = self.runner.kv_scales
        return None if scales is None else scales.cpu()

    def execute(self, out: SchedulerOutput, meta: Any) -> Any:
        """Run this rank's shard of the step (the all-gathered logits are rank 0's to
        sample); returns the rank's KV agent's report of the step."""
        agent = self.agent
        if agent is not None:
            agent.apply_step_meta(meta)
        connector = self.runner.kv_connector
        done: list[str] = []
        self.runner.runtime.before_step(out.num_batched_tokens)
        try:
            self.runner.compute_logits(out)
        finally:
            if connector is not None:
                done = connector.end_step()
        return agent.step_report(done) if agent is not None else None

    def sends_only(self, sends: list[Any], meta: Any) -> Any:
        """A step without a forward pass that carries sends (cancels): the agent's report."""
        agent = self.agent
        if agent is None:
            return None
        agent.apply_step_meta(meta)
        connector = agent.connector
        done: list[str] = []
        if connector is not None:
            connector.begin_step(sends)
            done = connector.end_step()
        return agent.step_report(done)

    def poll(self, meta: Any) -> Any:
        """Between steps: the agent's report of what finished meanwhile."""
        agent = self.agent
        if agent is None:
            return None
        agent.apply_step_meta(meta)
        connector = agent.connector
        return agent.step_report(connector.poll_finished() if connector is not None else [])

    def where(self) -> RankPlace:
        """Where this rank runs (operators and tests: ``IntegrityReport.tp_ranks``)."""
        node_id = None
        try:
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:  # pragma: no cover - mp workers without Ray installed
            pass
        return RankPlace(rank=self.runner.tp.rank, pid=os.getpid(), node_id=node_id)

    def control_call(self, method: str, *args: Any) -> Any:
        """The control channel (any thread, beside the steps): ``where``, or a method of
        the rank's KV agent."""
        if method == "where":
            return self.where()
        return self.agent_call(method, *args)

    def agent_call(self, method: str, *args: Any) -> Any:
        """``method`` of this rank's KV agent (a decode rank's receiver: expect, wait,
        cancel), outside the step loop."""
        if self.agent is None:
            raise ValueError("this rank has no KV agent")
        if method.startswith("_"):
            raise ValueError(f"agent method {method!r} is private")
        return getattr(self.agent, method)(*args)

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
        self.runner.tp.abort()


_WORKER_METHODS = frozenset(
    {
        "profile_num_blocks",
        "allocate_kv_cache",
        "warm_up",
        "kv_scales",
        "execute",
        "poll",
        "sends_only",
        "control_call",
        "shutdown",
    }
)


# ---- transports: how rank 0 reaches a worker ------------------------------------------------


class WorkerHandle(Protocol):
    def submit(self, method: str, *args: Any) -> None:
        """Start ``method`` on the worker (returns at once)."""

    def result(self, timeout: float) -> Any:
        """The reply to the oldest submitted call; TPWorkerError if the worker failed."""

    def call_agent(self, method: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        """``TPWorker.agent_call`` now, beside the step loop (thread-safe, concurrent);
        ``timeout`` None waits as long as the call takes."""

    def check_alive(self) -> None:
        """TPWorkerError if the worker is gone."""

    def close(self) -> None: ...


def _serve_control(worker: TPWorker, ctl: mp.connection.Connection) -> None:
    """The worker's control pipe: each agent call on its own thread, answered by id."""
    lock = threading.Lock()

    def answer(call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            reply = (call_id, "ok", worker.control_call(method, *args))
        except BaseException:
            reply = (call_id, "error", traceback.format_exc())
        with lock, contextlib.suppress(OSError):
            ctl.send(reply)

    while True:
        try:
            call_id, method, args = ctl.recv()
        except (EOFError, OSError):
            return
        threading.Thread(target=answer, args=(call_id, method, args), daemon=True).start()


def _mp_worker_main(
    spec: WorkerSpec, conn: mp.connection.Connection, ctl: mp.connection.Connection
) -> None:
    """A worker child process: start, then answer calls until the pipe closes."""
    try:
        worker = TPWorker(spec)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    threading.Thread(target=_serve_control, args=(worker, ctl), daemon=True).start()
    conn.send(("ok", None))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone: so is this replica
            os._exit(0)
        try:
            conn.send(("ok", worker.call(method, *args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        if method == "shutdown":
            return


class _ProcessWorker:
    """A worker in a child process of this one."""

    def __init__(self, spec: WorkerSpec) -> None:
        ctx = mp.get_context("spawn")
        self.rank = spec.rank
        self._conn, child = ctx.Pipe()
        self._ctl, child_ctl = ctx.Pipe()
        self.process = ctx.Process(
            target=_mp_worker_main,
            args=(spec, child, child_ctl),
            name=f"pdserve-tp{spec.rank}",
            daemon=True,
        )
        self.process.start()
        child.close()
        child_ctl.close()
        self._ctl_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count()
        threading.Thread(target=self._read_control, daemon=True).start()

    def _read_control(self) -> None:
        while True:
            try:
                call_id, status, value = self._ctl.recv()
            except (EOFError, OSError):
                break
            with self._ctl_lock:
                fut = self._calls.pop(call_id, None)
            if fut is None:
                continue
            if status == "ok":
                fut.set_result(value)
            else:
                why = f"tensor-parallel rank {self.rank} agent call failed:\n{value}"
                fut.set_exception(TPWorkerError(why))
        with self._ctl_lock:
            pending, self._calls = list(self._calls.values()), {}
        for fut in pending:
            fut.set_exception(TPWorkerError(f"tensor-parallel rank {self.rank} is gone"))

    def call_agent(self, method: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._ctl_lock:
            call_id = next(self._ids)
            self._calls[call_id] = fut
            try:
                self._ctl.send((call_id, method, args))
            except (BrokenPipeError, OSError) as exc:
                del self._calls[call_id]
                raise TPWorkerError(f"tensor-parallel rank {self.rank} is gone: {exc}") from exc
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            why = f"tensor-parallel rank {self.rank}: {method} took over {timeout} s"
            raise TPWorkerError(why) from exc

    def submit(self, method: str, *args: Any) -> None:
        try:
            self._conn.send((method, args))
        except (BrokenPipeError, OSError) as exc:
            raise TPWorkerError(f"tensor-parallel rank {self.rank} is gone: {exc}") from exc

    def result(self, timeout: float) -> Any:
        try:
            if not self._conn.poll(timeout):
                raise TPWorkerError(f"tensor-parallel rank {self.rank}: no reply in {timeout} s")
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            code = self.process.exitcode
            raise TPWorkerError(
                f"tensor-parallel rank {self.rank} died (exit code {code})"
            ) from exc
        if status != "ok":
            raise TPWorkerError(f"tensor-parallel rank {self.rank} failed:\n{value}")
        return value

    def check_alive(self) -> None:
        if not self.process.is_alive():
            code = self.process.exitcode
            raise TPWorkerError(f"tensor-parallel rank {self.rank} died (exit code {code})")

    def close(self) -> None:
        self._conn.close()
        self._ctl.close()
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


class _RayWorker:
    """A worker as a Ray actor in bundle ``rank`` of the caller's placement group."""

    def __init__(self, spec: WorkerSpec, placement_group: Any) -> None:
        self.rank = spec.rank
        self.actor = _start_actor(spec, placement_group)
        self._pending: list[Any] = [self.actor.__ray_ready__.remote()]

    def submit(self, method: str, *args: Any) -> None:
        self._pending.append(self.actor.call.remote(method, *args))

    def result(self, timeout: float) -> Any:
        import ray

        ref = self._pending.pop(0)
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError as exc:
            why = f"tensor-parallel rank {self.rank}: no reply in {timeout} s"
            raise TPWorkerError(why) from exc
        except ray.exceptions.RayError as exc:
            raise TPWorkerError(f"tensor-parallel rank {self.rank} failed: {exc}") from exc

    def call_agent(self, method: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        import ray

        try:
            ref = self.actor.call.remote("control_call", method, *args)
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayError as exc:
            why = f"tensor-parallel rank {self.rank}: {method} failed: {exc}"
            raise TPWorkerError(why) from exc

    def check_alive(self) -> None:
        import ray

        try:
            ray.get(self.actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayError as exc:
            raise TPWorkerError(f"tensor-parallel rank {self.rank} is gone: {exc}") from exc

    def close(self) -> None:
        import ray

        ray.kill(self.actor)


def _start_actor(spec: WorkerSpec, placement_group: Any) -> Any:
    """A TPWorker actor in bundle ``spec.rank`` of ``placement_group``. Its handle is
    untyped: Ray's stubs type neither its methods' ``.remote`` nor ``__ray_ready__``."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = placement_group.bundle_specs[spec.rank]
    return (
        ray.remote(TPWorker)
        .options(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            max_concurrency=4,  # connector calls run beside a step
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=spec.rank
            ),
            name=None,
        )
        .remote(spec)
    )


def _current_placement_group() -> Any:
    try:
        import ray
        from ray.util import get_current_placement_group
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return get_current_placement_group()


def start_workers(specs: list[WorkerSpec], how: str) -> list[WorkerHandle]:
    """Start ranks 1..tp-1 (``how``: 'mp', 'ray' or 'auto')."""
    pg = _current_placement_group() if how in ("auto", "ray") else None
    if how == "ray" and pg is None:
        raise ValueError(
            "tp_workers: 'ray' needs a placement group (deploy the pool with "
            "placement_group_bundles, one bundle per rank)"
        )
    if pg is not None:
        size = len(specs) + 1
        if len(pg.bundle_specs) < size:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} placement-group bundles, the "
                f"replica has {len(pg.bundle_specs)}"
            )
        return [_RayWorker(spec, pg) for spec in specs]
    return [_ProcessWorker(spec) for spec in specs]
