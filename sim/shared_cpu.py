"""Engines and streams on the CPUs a local cluster's serving processes share.

On a small machine ``pdserve up`` pins each decode engine to CPUs of its own and leaves the
rest shared by every other thread: Ray's daemons, the proxy, the ingress, the decode
replica's own threads, and an engine that has no CPUs of its own (the 2-core disaggregated
config's prefill replica, niced so that serving stays responsive).

The serving path's work on those CPUs is modelled as one queue of CPU seconds
(``SharedCpuLoad``): ``s_per_request`` arrives with each request (the ingress, routing,
admission), ``s_per_output_token`` with each token the decode engines emit (every token
is streamed through the decode replica's loop, the ingress and the proxy: this part follows
the decode batches) and ``s_per_decode_step`` with each decode step that streams, whatever
its batch (the decode replica's loop wakes once per step and each hop handles the chunks
that arrive together in one pass: a token in a batch of n costs the per-token part plus
1/n of the step's). The serving threads work it off at what the daemons leave
(``num_cpus x (1 - background)`` CPUs). So:

- a niced engine on the shared CPUs gets only a sliver while serving work is queued, and
  ``1 - background - streaming / num_cpus`` of them otherwise; its steps slow down or speed
  up as that share changes, and its process's own per-request work outside the steps
  (``engine_s_per_request``: its RPC, the KV send) runs at the same share;
- a request reaches the engines only once the serving work queued ahead of it and its own
  part (parse, tokenize, route, admit) are done: that work is on its critical path;
- a token reaches the client after the serving work queued ahead of it: when the decode
  batch streams more than the shared CPUs can carry, the client sees TTFT and TPOT grow
  although the decode engine's steps (on a CPU of its own) did not slow down.

All these numbers are measured by ``bench.sim_validate measure`` (``sim.cpu_account``'s /proc
accounting): the daemons during an idle spell; the serving path per request and per output
token from two calibration batches that differ only in their output length (one request
at a time: one token per step), per decode step from a third with the long one's requests
several at a time (the streams per step measured from its requests' first and last
tokens), per prompt token from one with longer prompts; the engine process's extra from
its CPU time less the step profile's compute of the prompts it prefilled in those
batches. None is fitted to latencies.

What this leaves out: a nice-0 engine on the shared CPUs would get a fair share rather than
the remainder (it is modelled as niced); jobs outside the cluster (threads free to run on
every CPU) take from every engine; the serving queue is first come first served although
the kernel shares the CPUs between its threads. The helper threads a bound engine may add
on the shared CPUs (the 2-core colocated config's) are modelled by ``HelperThreadsCost``
from two measured profiles, with and without them. Pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.deployments.config import AppConfig, PoolRole
from pdserve.sim.config import SharedCpuSettings
from pdserve.sim.cost import CostModel
from pdserve.sim.cpu_account import engine_cpu_s, serving_cpu_s
from pdserve.sim.events import Event, EventLoop

if TYPE_CHECKING:
    from pdserve.sim.engine import SimEngine

# Never model an engine as stopped outright: the kernel still hands a niced thread a sliver
# (about 1.5 % of a CPU at nice 19 against nice 0), and a zero share would stall the run.
MIN_SHARE = 0.02


class SharedCpuLoad:
    """The serving path on the shared CPUs, as one fluid queue of CPU work.

    Work arrives as ``s_per_request`` at each request's arrival and as
    ``s_per_output_token`` x the tokens the decode engines emit (``tokens_per_s``, told by
    ``tokens_changed`` whenever a decode engine starts a step); the serving threads work it
    off at ``capacity`` (the shared CPUs less the daemons). While work is queued, a niced
    engine on those CPUs gets only ``MIN_SHARE``; with none queued, what the streaming
    leaves. The engines in ``watch`` are told when their share changes (``rescale``: the
    step being computed goes faster or slower from then on). A token the decode engine
    emits reaches the client after the work queued ahead of it (``delay``).
    """

    def __init__(
        self,
        settings: SharedCpuSettings,
        loop: EventLoop,
        tokens_per_s: Callable[[], float] = lambda: 0.0,
        steps_per_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.settings = settings
        self.loop = loop
        self._tokens_per_s = tokens_per_s
        self._steps_per_s = steps_per_s
        self.capacity = settings.num_cpus * (1.0 - settings.background)
        self._backlog = 0.0  # CPU seconds of serving work queued, as of _at
        self._at = loop.now
        self._demand = 0.0  # CPU seconds per second the streaming asks for, since _at
        self._share = self._current_share()
        self._clears: Event | None = None
        self._engines: list[tuple[SimEngine, Callable[[float, float], float]]] = []

    def watch(
        self, engine: SimEngine, factor: Callable[[float, float], float] | None = None
    ) -> None:
        """Tell ``engine`` whenever the share changes: the rest of its step then takes
        ``factor(old share, new share)`` times as long (default old / new: an engine that
        computes at the share)."""
        self._engines.append((engine, factor or _at_the_share))

    def arrived(self, prompt_tokens: int = 0) -> None:
        """A request arrived: its per-request and per-prompt-token serving work."""
        self._advance()
        s = self.settings
        self._backlog += s.s_per_request + s.s_per_prompt_token * prompt_tokens
        self._changed()

    def tokens_changed(self) -> None:
        self._advance()
        s = self.settings
        self._demand = (
            s.s_per_output_token * self._tokens_per_s() + s.s_per_decode_step * self._steps_per_s()
        )
        self._changed()

    def share(self) -> float:
        """Fraction of the shared CPUs left to an engine computing on them, now."""
        return self._share

    def delay(self) -> float:
        """Seconds a token emitted now waits behind the serving work queued."""
        self._advance()
        return self._backlog / self.capacity

    def _current_share(self) -> float:
        if self._backlog > 0:
            return MIN_SHARE
        s = self.settings
        return max(MIN_SHARE, 1.0 - s.background - self._demand / s.num_cpus)

    def _advance(self) -> None:
        now = self.loop.now
        if now > self._at:
            left = self._backlog + (self._demand - self.capacity) * (now - self._at)
            self._backlog = left if left > 1e-12 else 0.0
            self._at = now

    def _changed(self) -> None:
        if self._clears is not None:
            self._clears.cancel()
            self._clears = None
        if self._backlog > 0 and self._demand < self.capacity:
            clear_in = self._backlog / (self.capacity - self._demand)
            self._clears = self.loop.after(clear_in, self._cleared)
        share = self._current_share()
        if share != self._share:
            old, self._share = self._share, share
            for engine, factor in self._engines:
                engine.rescale(factor(old, share))

    def _cleared(self) -> None:
        self._clears = None
        self._advance()
        self._backlog = 0.0
        self._changed()


class SharedCpuCost:
    """``cost`` for an engine on the shared CPUs: each step takes its time / ``share``, and
    each prompt it finishes adds the process's per-request work at that share
    (``request_s``, which ``SimEngine`` adds to the step that finishes the prompt)."""

    def __init__(self, cost: CostModel, load: SharedCpuLoad) -> None:
        self.cost = cost
        self.load = load
        self.kv_bytes_per_token = cost.kv_bytes_per_token
        self.kv_capacity_tokens = cost.kv_capacity_tokens
        self.num_layers = getattr(cost, "num_layers", 1)

    def step_s(self, tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: int) -> float:
        base = self.cost.step_s(tokens, prefill_attn, decode_seqs, decode_ctx)
        return base / self.load.share()

    def request_s(self, prompt_tokens: int) -> float:
        """Seconds the process's own work for one finished prompt takes now."""
        s = self.load.settings
        work = s.engine_s_per_request + s.engine_s_per_prompt_token * prompt_tokens
        return work / self.load.share()

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.cost.transfer_s(prompt_tokens)


def _at_the_share(old: float, new: float) -> float:
    return old / new


class HelperThreadsCost:
    """``cost`` for an engine bound to CPUs of its own that adds niced helper threads on the
    shared CPUs for steps of at least ``min_tokens`` tokens (a pool's ``cpu.helper_threads``;
    the linears hand out work dynamically). ``helper_cost`` is the step profile measured
    with the helpers on an idle CPU (``sim.profile --helper-threads``); a helper that gets
    the share ``s`` of its CPU adds that share of the speed-up it brings there:

        step = t1 / (1 + s x (t1 / t2 - 1))

    with t1 and t2 the two profiles' times for the step (measured, no fitted scaling). The
    step is rescaled as the share changes (``rescale_factor``)."""

    def __init__(
        self, cost: CostModel, helper_cost: CostModel, load: SharedCpuLoad, min_tokens: int
    ) -> None:
        self.cost, self.helper_cost, self.load = cost, helper_cost, load
        self.min_tokens = min_tokens
        self.kv_bytes_per_token = cost.kv_bytes_per_token
        self.kv_capacity_tokens = cost.kv_capacity_tokens
        self.num_layers = getattr(cost, "num_layers", 1)
        self._gain = 0.0  # of the step last timed: the one being computed (no macro steps)

    def step_s(self, tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: int) -> float:
        t1 = self.cost.step_s(tokens, prefill_attn, decode_seqs, decode_ctx)
        self._gain = 0.0
        if tokens < self.min_tokens or t1 <= 0:
            return t1
        t2 = self.helper_cost.step_s(tokens, prefill_attn, decode_seqs, decode_ctx)
        self._gain = max(0.0, t1 / t2 - 1.0) if t2 > 0 else 0.0
        return t1 / (1.0 + self.load.share() * self._gain)

    def rescale_factor(self, old: float, new: float) -> float:
        return (1.0 + old * self._gain) / (1.0 + new * self._gain)

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.cost.transfer_s(prompt_tokens)


def engines_on_shared_cpus(app: AppConfig, plan: dict) -> tuple[PoolRole, ...]:
    """The pools whose CPU engines the cluster's CPU plan (``CpuPlan.model_dump()``) leaves
    on the shared CPUs."""
    return tuple(
        role
        for role in _pools_in_use(app)
        if app.pool_device(role) == "cpu" and not plan[f"{role}_engine_cpus"]
    )


def _pools_in_use(app: AppConfig) -> tuple[PoolRole, ...]:
    colocated = app.prefill.max_replicas == 0 or app.policy.mode == "always_local"
    return ("decode",) if colocated else ("prefill", "decode")


def measured_settings(
    app: AppConfig,
    runs: list[tuple[dict, int]],
    prefill_compute_s: Callable[[int], float] | None = None,
) -> SharedCpuSettings | None:
    """``SharedCpuSettings`` from ``bench.sim_validate measure``'s ``cpu.json`` of runs of ``app``
    (each with its number of requests); None when nothing was measured, or when no engine
    of ``app`` computes on the shared CPUs and the serving path was not calibrated (with a
    calibration, such a cluster still streams its tokens through the shared CPUs).

    - ``background``: the daemons' share of the shared CPUs during the idle spell.
    - With a ``calibration`` record (batches of requests that differ only in their output
      length, or only in their prompt length): the serving path's CPU per output token
      (per prompt token) is the difference of two batches' serving CPU per request over the
      difference of their output (prompt) lengths, and per request what the short batch
      used besides its tokens. The prefill engine process's ``engine_s_per_request`` and
      ``engine_s_per_prompt_token`` likewise, from its niced CPU in the batches less its
      idle CPU and less ``prefill_compute_s(prompt)`` (the step profile's compute).
    - Without one (older measurements), all the serving CPU of the runs counts per request.
    """
    runs = [(cpu, n) for cpu, n in runs if cpu.get("plan") and n > 0]
    if not runs:
        return None
    plan = runs[0][0]["plan"]
    roles = engines_on_shared_cpus(app, plan)
    calibration = next((cpu["calibration"] for cpu, _ in runs if cpu.get("calibration")), None)
    if not roles and calibration is None:
        return None
    shared = tuple(plan["shared_cpus"])
    idles = [cpu["idle"] for cpu, _ in runs]
    background = sum(serving_cpu_s(i, shared) / i["wall_s"] for i in idles) / len(idles)
    background /= len(shared)
    per_token = per_step = per_prompt_token = engine = engine_per_token = 0.0
    if calibration is not None:
        per_request, per_token, per_step, per_prompt_token = _serving_costs(
            calibration, background, shared
        )
        if prefill_compute_s is not None and roles == ("prefill",):
            idle_engine = sum(engine_cpu_s(i, shared) / i["wall_s"] for i in idles) / len(idles)
            engine, engine_per_token = _engine_cost(
                calibration, idle_engine, shared, prefill_compute_s
            )
    else:
        costs = []
        for cpu, n in runs:
            run = cpu["run"]
            serving = serving_cpu_s(run, shared) - background * len(shared) * run["wall_s"]
            costs.append(max(0.0, serving) / n)
        per_request = sum(costs) / len(costs)
    return SharedCpuSettings(
        roles=roles,
        num_cpus=len(shared),
        s_per_request=per_request,
        s_per_output_token=per_token,
        s_per_decode_step=per_step,
        s_per_prompt_token=per_prompt_token,
        engine_s_per_request=engine,
        engine_s_per_prompt_token=engine_per_token,
        background=min(0.95, background),
    )


def _net_per_request(
    batch: dict, cpu_s: Callable[[dict, tuple[int, ...]], float], idle_rate: float, shared: tuple
) -> float:
    """CPU seconds per request of a calibration batch in ``cpu_s``'s threads, less what
    they use when idle (``idle_rate`` CPU-s per second) over the batch's wall time."""
    usage = batch["usage"]
    return (cpu_s(usage, shared) - idle_rate * usage["wall_s"]) / batch["requests"]


def streams_per_step(records: list[dict]) -> float | None:
    """How many requests stream at once, on average over the time at least one does
    (between its first and last token): the tokens a decode step hands out together, from
    ``bench.serve --save-requests`` records (send time, TTFT, E2E). None without any."""
    edges = sorted(
        edge
        for r in records
        if r.get("ok") and r.get("ttft") is not None and r.get("e2e") is not None
        for edge in ((r["send_time"] + r["ttft"], 1), (r["send_time"] + r["e2e"], -1))
    )
    area = covered = 0.0
    open_ = 0
    for (t, step), (t_next, _) in zip(edges, edges[1:], strict=False):
        open_ += step
        area += open_ * (t_next - t)
        covered += (t_next - t) if open_ > 0 else 0.0
    return area / covered if covered > 0 else None


def _streams(batch: dict) -> float:
    """A calibration batch's streams per step: measured, else its concurrency."""
    return batch.get("streams_per_step") or batch.get("concurrency") or 1.0


def _serving_costs(
    calibration: dict, background: float, shared: tuple[int, ...]
) -> tuple[float, float, float, float]:
    """(CPU s per request, per output token, per decode step, per prompt token) of the
    serving path, from the calibration batches: "short" and "long" differ only in their
    output length, "short" and "prompt" (when measured) only in their prompt length, and
    "streams" (when measured) is the long batch with several requests at a time. A token
    streamed in a batch of n costs per token + per step / n, so "long" (one stream) and
    "streams" (n on average, ``streams_per_step``) separate the two; without "streams"
    every token counts as its own step (per step 0)."""
    idle = background * len(shared)
    per = {
        name: max(0.0, _net_per_request(calibration[name], serving_cpu_s, idle, shared))
        for name in ("short", "long", "prompt", "streams")
        if name in calibration
    }
    short, long = calibration["short"], calibration["long"]
    extra_tokens = long["output_tokens"] - short["output_tokens"]
    if extra_tokens <= 0:
        raise ValueError(f"calibration: the long batch must have more output tokens: {calibration}")
    per_token = max(0.0, (per["long"] - per["short"]) / extra_tokens)  # one stream at a time
    per_step = 0.0
    if "streams" in per:
        streams = calibration["streams"]
        m_long, m_streams = _streams(long), _streams(streams)
        extra = streams["output_tokens"] - short["output_tokens"]
        if m_streams > m_long and extra > 0:
            shared_token = max(0.0, (per["streams"] - per["short"]) / extra)
            per_step = (per_token - shared_token) / (1 / m_long - 1 / m_streams)
            per_step = min(max(0.0, per_step), per_token * m_long)
            per_token -= per_step / m_long
    per_prompt_token = 0.0
    if "prompt" in per:
        extra_prompt = calibration["prompt"]["prompt_tokens"] - short["prompt_tokens"]
        if extra_prompt <= 0:
            raise ValueError(
                f"calibration: the prompt batch must have longer prompts: {calibration}"
            )
        per_prompt_token = max(0.0, (per["prompt"] - per["short"]) / extra_prompt)
    rest = per["short"] - (per_token + per_step) * short["output_tokens"]
    rest = max(0.0, rest - per_prompt_token * short["prompt_tokens"])
    return rest, per_token, per_step, per_prompt_token


def _engine_cost(
    calibration: dict,
    idle_rate: float,
    shared: tuple[int, ...],
    compute_s: Callable[[int], float],
) -> tuple[float, float]:
    """(CPU s per request, per prompt token) of the engine process on the shared CPUs
    besides its profiled steps: its CPU per request in the calibration batches less the
    profile's compute of their prompts; "short" and "long" (same prompts) averaged against
    "prompt" (longer prompts), when measured."""
    extra = {}
    for name in ("short", "long", "prompt"):
        if name in calibration:
            batch = calibration[name]
            net = _net_per_request(batch, engine_cpu_s, idle_rate, shared)
            extra[name] = net - compute_s(batch["prompt_tokens"])
    base = (extra["short"] + extra["long"]) / 2
    per_prompt_token = 0.0
    if "prompt" in extra:
        longer = calibration["prompt"]["prompt_tokens"] - calibration["short"]["prompt_tokens"]
        per_prompt_token = max(0.0, (extra["prompt"] - base) / longer)
    rest = base - per_prompt_token * calibration["short"]["prompt_tokens"]
    return max(0.0, rest), per_prompt_token
