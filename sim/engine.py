"""A simulated engine replica: pdserve's continuous-batching scheduler policy (see
``pdserve.engine.scheduler``) over a cost model instead of a model runner.

Per step, as the real scheduler does: running decodes first, then unfinished chunked
prefills, each taking tokens from ``max_num_batched_tokens``; the newest running request is
preempted by recompute when the KV pool is out of blocks; then waiting requests are
admitted (those holding landed remote KV first, then first come first served; a head that
does not fit blocks the rest). The step lasts ``cost.step_s(...)``.

Decoding requests are kept in aggregate (``DecodeSet``-style counters: how many, their total
context, how many start a new KV block at each step, a heap of finishing steps), so a step
costs O(log n) whatever its batch. A batch of decodes only, with nothing waiting, does not
change until its shortest request finishes or a request arrives; it is advanced as one
"macro step" of k steps (the cost is linear in context, so their total is exact), and cut
short at the step boundary after an arrival. That is what makes a 512-GPU hour simulate
in minutes.

It emits first tokens and finishes through callbacks and keeps the load numbers the real
engine reports (``EngineStats``), including its measured prefill rate
(``ThroughputMeter``, the engine's own class).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

from pdserve.engine.stats import EngineStats, ThroughputMeter
from pdserve.sim.cost import CostModel
from pdserve.sim.events import Event, EventLoop
from pdserve.sim.seq import (
    DECODING,
    GONE,
    PREFILLING,
    WAITING,
    Callback,
    EngineShape,
    Seq,
)
from pdserve.sim.seq import blocks as _blocks
from pdserve.sim.seq import noop as _noop

__all__ = ["EngineShape", "Seq", "SimEngine"]


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
        on_output_rate: Callable[[], None] | None = None,
    ) -> None:
        if shape.max_num_batched_tokens < shape.max_num_seqs:
            # Every running decode then fits in every step, as the aggregate assumes.
            raise ValueError(
                f"max_num_batched_tokens ({shape.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({shape.max_num_seqs}) to simulate"
            )
        self.loop, self.cost, self.shape = loop, cost, shape
        self.on_first_token, self.on_finish = on_first_token, on_finish
        self.macro_steps = macro_steps
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []
        self.remote: dict[int, Seq] = {}
        self.used_blocks = 0
        self._waiting_tokens = 0
        self._waiting_holders = 0  # waiting requests that hold blocks (landed remote KV)
        self.prefill_meter = ThroughputMeter()
        self.decode_meter = ThroughputMeter()
        self.num_preemptions = 0
        self.busy_s = 0.0
        # Decode tokens per second of the step being computed (0 when idle): what the
        # serving path streams right now (``shared_cpu``).
        self.output_rate = 0.0
        self.step_rate = 0.0  # and its steps per second, when it decodes (0 otherwise)
        self.on_output_rate = on_output_rate  # told when either changes
        # Per prompt finished, the process's own work outside the steps (``SharedCpuCost``).
        self._request_s = getattr(cost, "request_s", None)
        # The decoding requests, in aggregate.
        self._step = 0  # decode steps so far
        self._n = 0
        self._base = 0  # sum of (c0 - j): their context is _base + _n * _step
        self._phase = [0] * shape.block_size  # by (c0 - j) mod block_size
        self._heap: list[tuple[int, int, int, Seq]] = []  # (finish step, tie, j, seq)
        self._order: list[Seq] = []  # running requests by admission (preemption victims)
        # Landed remote KV: first tokens out at the end of the next step to start (as the
        # live engine streams them with that step's outputs), then at the end of this one.
        self._firsts: list[Seq] = []
        self._step_firsts: list[Seq] = []
        self._tie = 0
        self._step_end: Event | None = None
        self._batch: list[tuple[Seq, int]] = []
        self._step_began = 0.0
        self._prefill_tokens = 0
        self._decodes = 0
        # Macro step: k decode steps, the first lasting t0, each next one d longer.
        self._k = 1
        self._t0 = 0.0
        self._d = 0.0
        self._macro_blocks = 0

    # ------------------------------------------------------------------ intake
    def add(self, seq: Seq) -> None:
        self._wait(seq)
        self._poke()

    def reserve_remote(self, seq: Seq) -> bool:
        """Hold blocks for the whole prompt (False, nothing kept, when there is no room)."""
        need = _blocks(seq.req.prompt_tokens, self.shape.block_size)
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
        self._firsts.append(seq)
        if seq.req.output_tokens <= 1:
            # Done with its first token: its blocks are free at once, and it finishes with
            # the next step's outputs (now, if no step starts).
            self._free(seq)
            seq.state = GONE
        else:
            self._wait(seq, front=True)
        self._poke()

    def fail_remote(self, seq: Seq, kept: int = 0) -> None:
        """Recompute the prompt past the ``kept`` cached tokens here, into the reserved
        blocks."""
        del self.remote[seq.req.rid]
        seq.computed = kept
        self._wait(seq, front=True)
        self._poke()

    def abort(self, seq: Seq) -> None:
        """Drop a request that has not started decoding and free its blocks (a cancelled
        remote prefill)."""
        if seq.state == WAITING and seq in self.waiting:
            self._unwait(seq)
        elif seq.state == PREFILLING and all(s is not seq for s, _ in self._batch):
            self.prefilling.remove(seq)
        elif seq.state == PREFILLING:
            seq.aborted = True  # in the step being computed: dropped when it ends
            return
        else:
            return
        seq.state = GONE
        self._free(seq)

    # ------------------------------------------------------------------ queries
    @property
    def num_running(self) -> int:
        return self._n + len(self.prefilling)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self._n or self.remote or self._step_end)

    def queued_prefill_tokens(self) -> int:
        return self._waiting_tokens + sum(s.uncomputed for s in self.prefilling if s.uncomputed > 1)

    def stats(self) -> EngineStats:
        total = self.shape.num_blocks
        return EngineStats(
            num_running=self.num_running,
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

    # ------------------------------------------------------------------ waiting queue
    def _wait(self, seq: Seq, front: bool = False) -> None:
        # A waiting request's uncomputed tokens do not change until it is admitted.
        self._waiting_tokens += seq.uncomputed
        self._waiting_holders += seq.blocks > 0
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _unwait(self, seq: Seq, held: bool | None = None) -> None:
        """``held``: whether it held blocks while waiting (when they changed since)."""
        self.waiting.remove(seq)
        self._waiting_tokens -= seq.uncomputed
        self._waiting_holders -= (seq.blocks > 0) if held is None else held

    # ------------------------------------------------------------------ decode set
    def _join_decoding(self, seq: Seq) -> None:
        seq.state = DECODING
        seq.j, seq.c0, seq.o0 = self._step, seq.computed, seq.outputs
        self._n += 1
        self._base += seq.c0 - seq.j
        self._phase[(seq.c0 - seq.j) % self.shape.block_size] += 1
        self._tie += 1
        finish = seq.j + seq.req.output_tokens - seq.o0
        heapq.heappush(self._heap, (finish, self._tie, seq.j, seq))

    def _leave_decoding(self, seq: Seq) -> None:
        """Materialise its counters; its blocks stay counted (the caller frees them)."""
        done = self._step - seq.j
        seq.computed, seq.outputs = seq.c0 + done, seq.o0 + done
        seq.blocks = _blocks(seq.computed, self.shape.block_size)
        self._n -= 1
        self._base -= seq.c0 - seq.j
        self._phase[(seq.c0 - seq.j) % self.shape.block_size] -= 1
        seq.state = GONE

    def _new_blocks(self, k: int) -> int:
        """Blocks the decoding requests start over the next k steps (a request computing
        position c needs a new block when c is a multiple of the block size)."""
        if not self._n:
            return 0
        bs, step, total = self.shape.block_size, self._step, 0
        if k == 1:  # the one-step case of the loop below, as every single step asks
            return self._phase[-step % bs]
        for phase, count in enumerate(self._phase):
            if count:
                first = -(phase + step) % bs
                if first < k:
                    total += count * (1 + (k - 1 - first) // bs)
        return total

    def _next_finish(self) -> int | None:
        heap = self._heap
        while heap and (heap[0][3].state != DECODING or heap[0][3].j != heap[0][2]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    # ------------------------------------------------------------------ stepping
    def _poke(self) -> None:
        if self._step_end is None:
            self._start_step()
            if self.on_output_rate is not None and self.output_rate:
                self.on_output_rate()
        elif self._k > 1:
            self._cut_macro_step()

    def _alloc(self, seq: Seq, n: int) -> bool:
        need = _blocks(seq.computed + n, self.shape.block_size) - seq.blocks
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

    def _preempt_newest(self, scheduled: set[int]) -> Seq:
        """Preempt by recompute the newest running request not scheduled in this step."""
        order = self._order
        i = len(order) - 1
        while order[i].state not in (PREFILLING, DECODING) or id(order[i]) in scheduled:
            if order[i].state not in (PREFILLING, DECODING):
                del order[i]
            i -= 1
        victim = order.pop(i)
        if victim.state == DECODING:
            self._leave_decoding(victim)
        else:
            self.prefilling.remove(victim)
        self._free(victim)
        victim.computed = 0
        victim.state = WAITING
        self._wait(victim, front=True)
        self.num_preemptions += 1
        return victim

    def _schedule(self) -> tuple[list[tuple[Seq, int]], int]:
        """(prefill chunks and admitted requests with their tokens, decodes this step)."""
        budget = self.shape.max_num_batched_tokens
        batch: list[tuple[Seq, int]] = []
        scheduled: set[int] = set()
        preempted = False
        # Decodes first: every decoding request takes one token (the budget holds them).
        while self._n and self._new_blocks(1) > self.shape.num_blocks - self.used_blocks:
            self._preempt_newest(scheduled)
            preempted = True
        decodes = self._n
        self.used_blocks += self._new_blocks(1) if decodes else 0
        budget -= decodes
        for seq in list(self.prefilling):
            if budget == 0:
                break
            if seq.state != PREFILLING:
                continue  # preempted earlier in this loop
            n = min(seq.uncomputed, budget)
            while not self._alloc(seq, n):
                victim = self._preempt_newest(scheduled)
                preempted = True
                if victim is seq:
                    break
            if seq.state == PREFILLING:
                batch.append((seq, n))
                scheduled.add(id(seq))
                budget -= n
        if preempted or not self.waiting or self.num_running >= self.shape.max_num_seqs:
            return batch, decodes
        if self._waiting_holders:
            holders = [s for s in self.waiting if s.blocks]
            queue = holders + [s for s in self.waiting if not s.blocks]
        else:
            queue = list(self.waiting)
        for seq in queue:
            if budget == 0 or self.num_running >= self.shape.max_num_seqs:
                break
            n = min(seq.uncomputed, budget)
            held = seq.blocks > 0
            if not self._alloc(seq, n):
                if held:
                    continue
                break
            self._unwait(seq, held)
            if len(self._order) > 4 * self.num_running + 64:  # drop the finished ones
                self._order = [s for s in self._order if s.state in (PREFILLING, DECODING)]
            self._order.append(seq)
            if seq.uncomputed == 1 and seq.outputs:
                # Landed remote KV (its first token is out already): it decodes in this very
                # step. A one-token prompt also has one token to compute, but it is a
                # prefill: that step samples its first token.
                self._join_decoding(seq)
                decodes += 1
            else:
                seq.state = PREFILLING
                self.prefilling.append(seq)
                batch.append((seq, n))
            budget -= n
        return batch, decodes

    def _start_step(self) -> None:
        firsts, self._firsts = self._firsts, []
        if not (self.waiting or self.prefilling or self._n):
            self._emit_firsts(firsts)
            return
        batch, decodes = self._schedule()
        ctx = self._base + self._n * self._step  # admitted landed requests included
        if not batch and not decodes:
            self._emit_firsts(firsts)
            return  # waiting for blocks that only a finishing request frees
        self._step_firsts = firsts
        tokens = decodes
        attn = 0.0
        for seq, n in batch:
            tokens += n
            attn += n * (seq.computed + n / 2)
        k = 1
        if self.macro_steps and not batch and not self.waiting and not self._step_firsts:
            k = self._macro_length()
        t0 = self.cost.step_s(tokens, attn, decodes, ctx)
        if self._request_s is not None:
            for seq, n in batch:
                if seq.computed + n >= seq.num_tokens:
                    t0 += self._request_s(seq.req.prompt_tokens)
        self._k, self._t0, self._d = k, t0, 0.0
        if k > 1:
            t_last = self.cost.step_s(tokens, 0.0, decodes, ctx + decodes * (k - 1))
            self._d = (t_last - t0) / (k - 1)
        self._batch = batch
        self._decodes = decodes
        self._prefill_tokens = tokens - decodes
        self._step_began = self.loop.now
        span = self._span(k)
        self.output_rate = decodes * k / span if span > 0 else 0.0
        self.step_rate = k / span if span > 0 and decodes else 0.0
        self._step_end = self.loop.after(span, self._end_step)

    def _span(self, k: int) -> float:
        return k * self._t0 + self._d * k * (k - 1) / 2

    def _macro_length(self) -> int:
        finish = self._next_finish()
        k = (finish - self._step) if finish is not None else 1
        if k <= 1:
            return 1
        # The first step's blocks are allocated already; add the rest of the k steps'.
        self._step += 1
        more = self._new_blocks(k - 1)
        self._step -= 1
        if more > self.shape.num_blocks - self.used_blocks:
            return 1  # would run out of blocks: step by step, with preemption
        self.used_blocks += more
        self._macro_blocks = more
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
        self._step += 1
        kept = self._new_blocks(k - 1)
        self._step -= 1
        self.used_blocks -= self._macro_blocks - kept
        self._macro_blocks = kept
        self._k = k
        self._step_end = self.loop.at(self._step_began + self._span(k), self._end_step)

    def _emit_firsts(self, firsts: list[Seq]) -> None:
        for seq in firsts:
            self.on_first_token(seq, self.loop.now)
            if seq.state == GONE:  # its only token: done
                self.on_finish(seq, self.loop.now)

    def _end_step(self) -> None:
        now, k = self.loop.now, self._k
        seconds = now - self._step_began
        self.busy_s += seconds
        self._step_end = None
        self._macro_blocks = 0
        batch, self._batch = self._batch, []
        if self._decodes:
            self._step += k
        firsts, self._step_firsts = self._step_firsts, []
        self._emit_firsts(firsts)
        for seq, n in batch:
            if seq.aborted:
                self.prefilling.remove(seq)
                seq.state = GONE
                self._free(seq)
                continue
            seq.computed += n
            if seq.computed < seq.num_tokens:
                continue  # a prefill chunk that does not sample yet
            seq.outputs += 1
            if seq.outputs == 1:
                self.on_first_token(seq, now)
            self.prefilling.remove(seq)
            if seq.outputs >= seq.req.output_tokens or seq.prefill_only:
                self._finish(seq, now)
            else:
                self._join_decoding(seq)
        while (finish := self._next_finish()) is not None and finish <= self._step:
            seq = heapq.heappop(self._heap)[3]
            self._leave_decoding(seq)
            self._finish(seq, now)
        self.prefill_meter.update(self._prefill_tokens, seconds)
        self.decode_meter.update(self._decodes * k, seconds)
        rates = (self.output_rate, self.step_rate)
        self.output_rate = self.step_rate = 0.0
        self._start_step()
        if self.on_output_rate is not None and (self.output_rate, self.step_rate) != rates:
            self.on_output_rate()

    def _finish(self, seq: Seq, now: float) -> None:
        seq.state = GONE
        if not seq.prefill_only:
            self._free(seq)
        self.on_finish(seq, now)

    def release(self, seq: Seq) -> None:
        """A prefill_only request's KV send finished: its blocks are free again."""
        self._free(seq)
        if self._step_end is None:
            self._start_step()

    def rescale(self, factor: float) -> None:
        """The rest of the step being computed takes ``factor`` times as long (the engine's
        share of its CPUs changed). Single steps only: an engine that is rescaled runs
        without macro steps."""
        end = self._step_end
        if end is None or factor == 1.0:
            return
        assert self._k == 1, "rescale needs macro_steps=False"
        now = self.loop.now
        end.cancel()
        self._step_end = self.loop.at(now + (end.time - now) * factor, self._end_step)
