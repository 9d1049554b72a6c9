"""A simulated engine replica: pdserve's continuous-batching scheduler policy (see
``pdserve.engine.scheduler``) over a cost model instead of a model runner.

Per step, as the real scheduler does: running decodes first, then unfinished chunked
prefills, each taking tokens from ``max_num_batched_tokens``; the newest running request is
preempted by recompute when the KV pool is out of blocks; then waiting requests are
admitted (those holding landed remote KV first, then first come first served; a head that
does not fit blocks the rest). The step lasts ``cost.step_s(...)``.

A batch of decodes only, with nothing waiting, does not change until its shortest request
finishes or a request arrives; it is advanced as one "macro step" of k steps (the cost is
linear in context, so their total is exact), and cut short at the step boundary after an
arrival. That is what makes a 512-GPU hour simulate in seconds.

It emits first tokens and finishes through callbacks and keeps the load numbers the real
engine reports (``EngineStats``), including its measured prefill rate
(``ThroughputMeter``, the engine's own class).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.stats import EngineStats, ThroughputMeter
from pdserve.sim.cost import CostModel
from pdserve.sim.events import Event, EventLoop
from pdserve.sim.request import SimRequest


@dataclass(frozen=True)
class EngineShape:
    """A replica's engine limits (``EngineLimits`` of its pool)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Seq:
    """A request's state inside one engine (its prompt may be recomputed after preemption)."""

    __slots__ = ("req", "computed", "outputs", "blocks", "prefill_only", "first_pending", "aborted")

    def __init__(self, req: SimRequest, prefill_only: bool = False) -> None:
        self.req = req
        self.computed = 0
        self.outputs = 0
        self.blocks = 0
        self.prefill_only = prefill_only
        self.first_pending = False
        self.aborted = False

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_tokens + self.outputs

    @property
    def uncomputed(self) -> int:
        return self.req.prompt_tokens + self.outputs - self.computed


Callback = Callable[[Seq, float], None]


def _noop(seq: Seq, t: float) -> None:
    return None


class SimEngine:
    """One replica's engine. ``add`` / ``reserve_remote`` / ``complete_remote`` /
    ``fail_remote`` / ``abort`` mirror the real engine's calls."""

    def __init__(
        self,
        loop: EventLoop,
        cost: CostModel,
        shape: EngineShape,
        *,
        on_first_token: Callback = _noop,
        on_finish: Callback = _noop,
        macro_steps: bool = True,
    ) -> None:
        self.loop, self.cost, self.shape = loop, cost, shape
        self.on_first_token, self.on_finish = on_first_token, on_finish
        self.macro_steps = macro_steps
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.remote: dict[int, Seq] = {}
        self.used_blocks = 0
        self.prefill_meter = ThroughputMeter()
        self.decode_meter = ThroughputMeter()
        self.num_preemptions = 0
        self.busy_s = 0.0
        self._step_end: Event | None = None
        self._batch: list[tuple[Seq, int]] = []
        self._step_began = 0.0
        # Macro step: k decode steps, the first lasting t0, each next one d longer.
        self._k = 1
        self._t0 = 0.0
        self._d = 0.0

    # ------------------------------------------------------------------ intake
    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)
        self._poke()

    def reserve_remote(self, seq: Seq) -> bool:
        """Hold blocks for the whole prompt (False, nothing kept, when there is no room)."""
        need = -(-seq.req.prompt_tokens // self.shape.block_size)
        if need > self.shape.num_blocks - self.used_blocks:
            return False
        seq.blocks = need
        self.used_blocks += need
        self.remote[seq.req.rid] = seq
        return True

    def complete_remote(self, seq: Seq) -> None:
        """The KV landed: the first token is out at the end of the next step."""
        del self.remote[seq.req.rid]
        seq.computed = seq.req.prompt_tokens
        seq.outputs = 1
        if seq.req.output_tokens <= 1:
            # Done with its first token: out with the next step's outputs (now, if idle).
            end = self._step_end.time if self._step_end is not None else self.loop.now
            self.loop.at(end, self._finish_landed, seq)
            return
        seq.first_pending = True
        self.waiting.appendleft(seq)
        self._poke()

    def _finish_landed(self, seq: Seq) -> None:
        self._free(seq)
        self.on_first_token(seq, self.loop.now)
        self.on_finish(seq, self.loop.now)

    def fail_remote(self, seq: Seq) -> None:
        """Recompute the prompt here, into the reserved blocks."""
        del self.remote[seq.req.rid]
        seq.computed = 0
        self.waiting.appendleft(seq)
        self._poke()

    def abort(self, seq: Seq) -> None:
        """Drop a request wherever it is and free its blocks (a cancelled remote prefill)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running and all(s is not seq for s, _ in self._batch):
            self.running.remove(seq)
        elif seq in self.running:
            seq.aborted = True  # in the step being computed: dropped when it ends
            return
        else:
            return
        self._free(seq)

    # ------------------------------------------------------------------ queries
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.remote or self._step_end)

    def queued_prefill_tokens(self) -> int:
        waiting = sum(s.uncomputed for s in self.waiting)
        return waiting + sum(s.uncomputed for s in self.running if s.uncomputed > 1)

    def stats(self) -> EngineStats:
        total = self.shape.num_blocks
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_remote_kv=len(self.remote),
            num_sending_kv=0,
            num_free_blocks=total - self.used_blocks,
            num_total_blocks=total,
            block_size=self.shape.block_size,
            queued_prefill_tokens=self.queued_prefill_tokens(),
            prefill_tokens_per_s=self.prefill_meter.rate,
            decode_tokens_per_s=self.decode_meter.rate,
            kv_usage=self.used_blocks / total,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_prompt_tokens=0,
            num_generation_tokens=0,
        )

    # ------------------------------------------------------------------ stepping
    def _poke(self) -> None:
        if self._step_end is None:
            self._start_step()
        elif self._k > 1:
            self._cut_macro_step()

    def _alloc(self, seq: Seq, n: int) -> bool:
        need = -(-(seq.computed + n) // self.shape.block_size) - seq.blocks
        if need <= 0:
            return True
        if need > self.shape.num_blocks - self.used_blocks:
            return False
        seq.blocks += need
        self.used_blocks += need
        return True

    def _free(self, seq: Seq) -> None:
        self.used_blocks -= seq.blocks
        seq.blocks = 0

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _schedule(self) -> list[tuple[Seq, int]]:
        budget = self.shape.max_num_batched_tokens
        batch: list[tuple[Seq, int]] = []
        scheduled: set[int] = set()
        preempted = False
        decodes = [s for s in self.running if s.uncomputed == 1]
        prefills = [s for s in self.running if s.uncomputed > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq not in self.running:
                continue  # preempted earlier in this loop
            n = min(seq.uncomputed, budget)
            while not self._alloc(seq, n):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq in self.running:
                batch.append((seq, n))
                scheduled.add(id(seq))
                budget -= n
        if preempted:
            return batch
        holders = [s for s in self.waiting if s.blocks]
        for seq in holders + [s for s in self.waiting if not s.blocks]:
            if budget == 0 or len(self.running) >= self.shape.max_num_seqs:
                break
            n = min(seq.uncomputed, budget)
            if not self._alloc(seq, n):
                if seq.blocks:
                    continue
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def _start_step(self) -> None:
        pending = [s for s in self.waiting if s.first_pending]
        if not (self.waiting or self.running):
            return
        batch = self._schedule()
        if not batch and not pending:
            return  # waiting for blocks that only a finishing request frees
        tokens = prefill = decode_seqs = decode_ctx = 0
        attn = 0.0
        for seq, n in batch:
            tokens += n
            if seq.computed >= seq.req.prompt_tokens:
                decode_seqs += 1
                decode_ctx += seq.computed
            else:
                prefill += n
                attn += n * (seq.computed + n / 2)
        k = 1
        if (
            self.macro_steps
            and batch
            and not self.waiting
            and tokens == decode_seqs
            and not any(s.first_pending for s, _ in batch)  # a first token ends the step
        ):
            k = self._macro_length(batch)
        t0 = self.cost.step_s(tokens, attn, decode_seqs, decode_ctx)
        self._k, self._t0 = k, t0
        self._d = 0.0
        if k > 1:
            t_last = self.cost.step_s(tokens, 0.0, decode_seqs, decode_ctx + decode_seqs * (k - 1))
            self._d = (t_last - t0) / (k - 1)
        self._batch = batch
        self._prefill_tokens = prefill
        self._step_began = self.loop.now
        self._step_end = self.loop.after(self._span(k), self._end_step)

    def _span(self, k: int) -> float:
        return k * self._t0 + self._d * k * (k - 1) / 2

    def _macro_length(self, batch: list[tuple[Seq, int]]) -> int:
        k = min(s.req.output_tokens - s.outputs for s, _ in batch)
        if k <= 1:
            return 1
        bs = self.shape.block_size
        need = sum(-(-(s.computed + k) // bs) - s.blocks for s, _ in batch)
        if need > self.shape.num_blocks - self.used_blocks:
            return 1  # would run out of blocks: step by step, with preemption
        for seq, _ in batch:
            self._alloc(seq, k)
        return k

    def _cut_macro_step(self) -> None:
        """An arrival during a macro step: end it at the next step boundary."""
        elapsed = self.loop.now - self._step_began
        done = 0
        while done < self._k and self._span(done + 1) <= elapsed:
            done += 1
        k = min(self._k, done + 1)
        if k == self._k:
            return
        assert self._step_end is not None
        self._step_end.cancel()
        self._k = k
        self._step_end = self.loop.at(self._step_began + self._span(k), self._end_step)

    def _end_step(self) -> None:
        now, k = self.loop.now, self._k
        seconds = now - self._step_began
        self.busy_s += seconds
        self._step_end = None
        batch, self._batch = self._batch, []
        for seq in [s for s in self.waiting if s.first_pending] + [s for s, _ in batch]:
            if seq.first_pending:
                seq.first_pending = False
                self.on_first_token(seq, now)
        decoded = 0
        for seq, n in batch:
            if seq.aborted:
                self.running.remove(seq)
                self._free(seq)
                continue
            if k > 1:
                seq.computed += k
                seq.outputs += k
                decoded += k
            else:
                was_decode = seq.computed >= seq.req.prompt_tokens
                seq.computed += n
                if seq.computed < seq.num_tokens:
                    continue  # a prefill chunk that does not sample yet
                seq.outputs += 1
                decoded += was_decode
                if seq.outputs == 1:
                    self.on_first_token(seq, now)
            if seq.outputs >= seq.req.output_tokens or seq.prefill_only:
                self._finish(seq, now)
        if k > 1:
            bs = self.shape.block_size
            for seq, _ in batch:
                if seq.blocks:
                    right = -(-seq.computed // bs)
                    self.used_blocks -= seq.blocks - right
                    seq.blocks = right
        self.prefill_meter.update(self._prefill_tokens, seconds)
        self.decode_meter.update(decoded, seconds)
        self._start_step()

    def _finish(self, seq: Seq, now: float) -> None:
        self.running.remove(seq)
        if not seq.prefill_only:
            self._free(seq)
        self.on_finish(seq, now)

    def release(self, seq: Seq) -> None:
        """A prefill_only request's KV send finished: its blocks are free again."""
        self._free(seq)
        self._poke_idle()

    def _poke_idle(self) -> None:
        if self._step_end is None:
            self._start_step()
