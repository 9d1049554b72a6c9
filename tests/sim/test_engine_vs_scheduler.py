"""Differential test: the simulator's engine (``sim.engine.SimEngine``) and the live
scheduler (``engine.scheduler.Scheduler`` with its ``KVCacheManager``) fed the same trace
(arrivals, prompt and output lengths, token budget, ``max_num_seqs``, block count and size)
run the same schedule: step by step, the same requests with the same number of tokens each,
the same preemptions, and every request's first token and finish in the same step.

What the simulator leaves out, and how the trace keeps to it:
  - no prefix cache: the live KV cache manager runs with prefix caching off (the prompts
    are distinct anyway);
  - no stop tokens or strings: every request produces exactly its output length
    (``ignore_eos``, ``max_tokens``), the live tokens come from the fake runner of
    ``tests/engine/fakes.py``;
  - remote prefills always land (no failed or cancelled transfer), with at least two
    output tokens (the first comes with the KV); and traces with remote prefills get a
    pool with room for every request at once, because the simulator grants or refuses a
    reservation at the request's arrival, mid-step, where the live engine decides it
    between steps, after the finished requests of the step freed their blocks (near a
    full pool the two then differ; the simulator's cluster would need to wait for the
    step boundary to match);
  - time is the cost model's: both sides take one second per step, and each arrival has a
    fraction of a second of its own, so no arrival ever ties with a step boundary; a
    request that arrives during a step joins at the next one, and one that arrives when
    the engine is idle starts a step at once;
  - the simulator's macro steps are off (they time k decode steps as one event; their
    times are checked against single steps in ``test_engine.py``);
  - ``max_num_batched_tokens >= max_num_seqs`` (every running decode fits every step),
    which the simulator requires.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pdserve.sim.engine import EngineShape, Seq, SimEngine
from pdserve.sim.events import EventLoop
from pdserve.sim.request import SimRequest
from pdserve.sim.seq import DECODING
from tests.engine.fakes import Harness, make_request

STEP_S = 1.0

Step = dict[int, int]  # request id -> tokens computed for it in the step


@dataclass(frozen=True)
class Trace:
    shape: EngineShape
    # (arrival s, prompt tokens, output tokens, None or when its remote KV lands): a
    # request with a landing time reserves blocks for its prompt on arrival (the decode
    # role) and joins the queue when its KV lands; if no blocks are free it is prefilled
    # here instead, as the decode server does.
    requests: tuple[tuple[float, int, int, float | None], ...]


class OneSecondSteps:
    """A cost model whose every step lasts ``STEP_S``, whatever it computes."""

    kv_bytes_per_token = 1
    kv_capacity_tokens = 1 << 20
    num_layers = 1

    def step_s(self, tokens: int, prefill_attn: float, decode_seqs: int, decode_ctx: int) -> float:
        return STEP_S

    def transfer_s(self, prompt_tokens: int) -> float:
        return 0.0


class RecordingSimEngine(SimEngine):
    """The simulated engine, noting each step's batch as it is scheduled."""

    def __init__(self, loop: EventLoop, shape: EngineShape, seqs: list[Seq]) -> None:
        super().__init__(loop, OneSecondSteps(), shape, macro_steps=False)
        self.seqs = seqs
        self.steps: list[Step] = []

    def _schedule(self) -> tuple[list[tuple[Seq, int]], int]:
        batch, decodes = super()._schedule()
        if batch or decodes:
            step = {seq.req.rid: n for seq, n in batch}
            decoding = [s.req.rid for s in self.seqs if s.state == DECODING]
            assert len(decoding) == decodes  # the aggregate agrees with the requests' states
            step.update((rid, 1) for rid in decoding)
            self.steps.append(step)
        return batch, decodes


def simulated(trace: Trace) -> tuple[list[Step], int, dict[int, tuple[float, float]]]:
    """(steps, preemptions, request id -> (first token time, finish time)) of the sim."""
    loop = EventLoop()
    requests = [SimRequest(i, a, p, o) for i, (a, p, o, _) in enumerate(trace.requests)]
    seqs = [Seq(r) for r in requests]
    engine = RecordingSimEngine(loop, trace.shape, seqs)
    engine.on_first_token = lambda s, t: setattr(s.req, "first_token_at", t)
    engine.on_finish = lambda s, t: setattr(s.req, "finished_at", t)

    def arrive(seq: Seq, landed_at: float | None) -> None:
        if landed_at is not None and engine.reserve_remote(seq):
            loop.at(landed_at, engine.complete_remote, seq)
        else:
            engine.add(seq)

    for seq, (_, _, _, landed_at) in zip(seqs, trace.requests, strict=True):
        loop.at(seq.req.arrival, arrive, seq, landed_at)
    loop.run()
    assert engine.idle and engine.used_blocks == 0
    times = {r.rid: (r.first_token_at, r.finished_at) for r in requests}
    return engine.steps, engine.num_preemptions, times  # type: ignore[return-value]


def live(trace: Trace) -> tuple[list[Step], int, dict[int, tuple[float, float]]]:
    """The same, from the live scheduler stepped on the same clock."""
    shape = trace.shape
    harness = Harness(
        num_blocks=shape.num_blocks,
        block_size=shape.block_size,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_num_seqs=shape.max_num_seqs,
        max_model_len=1 << 16,
        enable_prefix_caching=False,
    )
    rng = random.Random(0)
    # (time, request id, what): arrivals, and the landing of a reserved request's KV.
    events = sorted((a, i, "arrive") for i, (a, *_) in enumerate(trace.requests))
    steps: list[Step] = []
    first: dict[int, float] = {}
    finished: dict[int, float] = {}
    now = 0.0

    def handle(i: int, what: str) -> None:
        _, prompt, output, landed_at = trace.requests[i]
        if what == "land":
            harness.scheduler.complete_remote_prefill(str(i), rng.randrange(1, 50))
            return
        request = make_request(
            str(i), [rng.randrange(1, 50) for _ in range(prompt)], max_tokens=output,
            ignore_eos=True,
        )  # fmt: skip
        blocks = None if landed_at is None else harness.scheduler.reserve_remote_prefill(request)
        if blocks is not None:
            # What the KV transfer does: the prompt's KV lands in the reserved blocks.
            harness.runner.write(blocks, 0, request.prompt_token_ids)
            events.append((landed_at, i, "land"))
            events.sort()
        else:
            harness.add(request)

    while events or harness.scheduler.has_work():
        if not harness.scheduler.has_work():
            now = max(now, events[0][0])  # idle: the next event starts a step
        while events and events[0][0] <= now:
            _, i, what = events.pop(0)
            handle(i, what)
        seen = {rid: len(outs) for rid, outs in harness.outputs.items()}
        out = harness.step()
        if not out.chunks:
            assert events, "the live scheduler is stuck with nothing left to happen"
            now = events[0][0]
            continue
        steps.append({int(c.request_id): len(c.token_ids) for c in out.chunks})
        now += STEP_S
        for rid, outs in harness.outputs.items():
            if len(outs) > seen.get(rid, 0):
                first.setdefault(int(rid), now)
                if outs[-1].finished:
                    finished[int(rid)] = now
    harness.assert_empty()
    times = {rid: (first[rid], finished[rid]) for rid in finished}
    return steps, harness.scheduler.num_preemptions, times


def random_trace(seed: int) -> Trace:
    r = random.Random(seed)
    block_size = r.choice([4, 8, 16])
    max_num_seqs = r.randint(2, 8)
    num_blocks = r.randint(12, 40)
    capacity = num_blocks * block_size
    requests = []
    t = 0.0
    n = r.randint(8, 30)
    remote_share = r.choice([0.0, 0.0, 0.5])
    for i in range(n):
        t += r.choice([0, 0, 1, 2, 5, 20])
        # Each event has a fraction of a second of its own: none ties with a step boundary.
        arrival = t + (2 * i + 1) / (4 * (n + 1))
        prompt = r.randint(1, min(120, capacity // 2))
        landed_at = None
        if r.random() < remote_share:
            landed_at = t + r.randint(1, 6) + (2 * i + 2) / (4 * (n + 1))
        low = 2 if landed_at is not None else 1
        output = r.randint(low, max(low, min(40, capacity - prompt)))
        requests.append((arrival, prompt, output, landed_at))
    if remote_share:
        # Room for every request at once: the simulator decides a reservation when the
        # request arrives, mid-step, where the live engine decides it between steps, after
        # the step's finished requests freed their blocks; with a pool this size both
        # always grant it.
        num_blocks = sum(-(-(p + o) // block_size) for _, p, o, _ in requests)
    shape = EngineShape(
        max_num_batched_tokens=r.randint(max_num_seqs, 96),
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        num_blocks=num_blocks,
    )
    return Trace(shape, tuple(requests))


def _first_difference(a: list[Step], b: list[Step]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"step {i}: sim {dict(sorted(x.items()))} vs live {dict(sorted(y.items()))}"
    return f"{len(a)} sim steps vs {len(b)} live steps"


@pytest.mark.parametrize("seed", range(40))
def test_the_simulated_engine_schedules_what_the_live_scheduler_does(seed: int) -> None:
    trace = random_trace(seed)
    sim_steps, sim_preemptions, sim_times = simulated(trace)
    live_steps, live_preemptions, live_times = live(trace)
    assert sim_steps == live_steps, f"{trace.shape}: {_first_difference(sim_steps, live_steps)}"
    assert sim_preemptions == live_preemptions
    assert sim_times == live_times


def test_the_traces_reach_the_cases_that_matter() -> None:
    """The seeds above cover chunked prefills, full batches and preemption, so the
    comparison is not only of easy schedules."""
    chunked = preempted = full = landed = 0
    for seed in range(40):
        trace = random_trace(seed)
        steps, preemptions, _ = simulated(trace)
        prompts = {i: p for i, (_, p, *_) in enumerate(trace.requests)}
        chunked += any(1 < n < prompts[rid] for step in steps for rid, n in step.items())
        preempted += preemptions > 0
        full += any(len(step) == trace.shape.max_num_seqs for step in steps)
        landed += any(landed_at is not None for *_, landed_at in trace.requests)
    assert chunked >= 10 and preempted >= 5 and full >= 10 and landed >= 5, (
        chunked, preempted, full, landed,
    )  # fmt: skip
