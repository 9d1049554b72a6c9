"""Continuous-batching scheduler: which tokens of which requests run in the next step.

Policy (one ``schedule()`` call):
  1. Running requests first, decodes before unfinished chunked prefills, each taking tokens
     from the step budget (``max_num_batched_tokens``). When the KV pool is out of blocks the
     newest running request not yet scheduled this step is preempted by recompute (its blocks
     are freed and it goes back to the front of the queue).
  2. If nothing was preempted, waiting requests are admitted while budget, ``max_num_seqs``
     and blocks allow: those already holding blocks (remote KV landed) first, then
     first-come-first-served; a long prompt gets a chunk of what is left (chunked prefill).
     A request that does not fit blocks those behind it.
``update_from_output`` then appends the sampled tokens and applies the stop rules.

Role hooks: ``prefill_only`` requests finish after their first token and keep their blocks
until the KV connector reports their send finished. With a connector, every step that
computes a chunk of such a prompt announces the blocks that chunk completes (``PendingSend``),
so a long prompt's KV moves while its later chunks are computed. A prefill_only request
that leaves before its final chunk once its transfer began (aborted, or chosen for
preemption) gets a ``cancel`` send: the decode side is told the transfer failed and falls
back to computing the prompt itself. Preemption therefore *aborts* such a request rather
than restarting it: a restart would send its blocks a second time, which the receiver
treats as a protocol violation, and the decode side's fallback costs what a restart here
would. ``reserve_remote_prefill`` / ``complete_remote_prefill`` / ``fail_remote_prefill``
serve the decode role: the reservation keeps the prefix cache's hit, asks the connector's
scheduler half how many prompt tokens it loads from elsewhere (the rest: a delta hand-off)
and tells it which blocks receive them.

Never imports torch and never touches tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import KVConnectorScheduler, PendingSend
from pdserve.engine.output_processor import check_stop, make_output
from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput

_FINISHED_STATES = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
)


class SampledTokenLike(Protocol):
    """pdserve.engine.sampler.SampledToken, seen from here without importing torch.

    Read-only members, so a frozen dataclass satisfies it: the scheduler only reads them.
    """

    @property
    def token_id(self) -> int: ...

    @property
    def logprob(self) -> float | None: ...

    @property
    def top_logprobs(self) -> list[tuple[int, float]] | None: ...


class Scheduler:
    """Queues, admission, preemption and the per-token stop rules."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        has_kv_connector: bool = False,
        kv_connector: KVConnectorScheduler | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``kv_connector`` is the connector's scheduler half (it implies
        ``has_kv_connector``); without one a remote reservation expects the whole prompt
        and the caller moves its KV itself."""
        self.kv = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.has_kv_connector = has_kv_connector or kv_connector is not None
        self.kv_connector = kv_connector
        self.clock = clock

        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}
        # Finished prefill_only requests whose blocks the KV connector is still reading.
        self.sending: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # every request that holds or may hold blocks
        # prefill_only requests whose transfer began: blocks announced so far (prompt order).
        self._blocks_announced: dict[str, int] = {}
        # Transfers to cancel in the next step (their requests left before the final chunk).
        self._cancelled_sends: list[str] = []
        # Requests whose prompt KV the connector loads: it hears when each one leaves.
        self._external_loads: set[str] = set()

        self._scheduled: list[tuple[Request, ScheduledChunk]] = []
        self._left_ids: list[str] = []
        self._pending_outputs: list[RequestOutput] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0

    # ------------------------------------------------------------------ queries
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.remote)

    def has_work(self) -> bool:
        """Whether calling step() can make progress (schedule tokens or emit outputs)."""
        return bool(self.waiting or self.running or self._pending_outputs)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def live_requests(self) -> Iterable[Request]:
        return self.requests.values()

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted or queued but not yet computed (a TTFT predictor input)."""
        waiting = sum(r.num_uncomputed_tokens for r in self.waiting)
        running = sum(r.num_uncomputed_tokens for r in self.running if r.num_uncomputed_tokens > 1)
        return waiting + running

    # ------------------------------------------------------------------ intake
    def add_request(self, request: Request) -> None:
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"new request {request.request_id} must be WAITING")
        self._register(request)
        self.waiting.append(request)

    def reserve_remote_prefill(self, request: Request) -> list[int] | None:
        """Decode role: hold blocks for the prompt; None (nothing kept) if no room.

        With a connector the prefix cache's hit (full blocks) is kept and only the rest of
        the prompt is loaded (a delta hand-off): the connector says how many prompt tokens it
        loads past those already here and learns the whole block table. The load must cover
        the rest of the prompt: the first token comes with it. Without a connector the
        caller moves the whole prompt's KV itself, so nothing is taken from the cache.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        connector = self.kv_connector
        hits: list[int] = []
        num_computed = 0
        if connector is not None:
            hits, num_computed = self.kv.get_computed_blocks(request)
        num_external = request.num_prompt_tokens - num_computed
        if connector is not None:
            num_external = connector.get_num_new_matched_tokens(
                request.request_id, request.num_prompt_tokens, num_computed
            )
            if num_computed + num_external != request.num_prompt_tokens:
                raise ValueError(
                    f"request {request.request_id!r}: the KV connector loads {num_external} of "
                    f"its {request.num_prompt_tokens - num_computed} uncomputed prompt tokens; "
                    "a remote prefill must cover all of them"
                )
        if self.kv.allocate_slots(request, num_external, hits) is None:
            return None
        if connector is not None and self.kv.enable_prefix_caching:
            self.kv.record_prefix_lookup(request.num_prompt_tokens, num_computed)
        request.num_computed_tokens = num_computed
        request.num_cached_tokens = num_computed
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._register(request)
        self.remote[request.request_id] = request
        if connector is not None:
            self._external_loads.add(request.request_id)
            connector.update_state_after_alloc(
                request.request_id, list(request.block_ids), num_computed, num_external
            )
        return list(request.block_ids)

    def complete_remote_prefill(
        self,
        request_id: str,
        first_token_id: int,
        first_logprob: TokenLogprob | None = None,
        num_cached_tokens: int | None = None,
    ) -> None:
        """The KV landed in the reserved blocks: append the first token, join the queue front.

        ``num_cached_tokens``: prompt tokens the prefill side did not compute (its prefix
        cache's hit), reported as the request's cached tokens; None keeps this side's hit.
        The first token's output is returned by the next ``update_from_output``.
        """
        request = self._remote_request(request_id)
        if num_cached_tokens is not None and not 0 <= num_cached_tokens < request.num_prompt_tokens:
            raise ValueError(
                f"num_cached_tokens: {num_cached_tokens} is not in [0, "
                f"{request.num_prompt_tokens}) for request {request_id!r}"
            )
        del self.remote[request_id]
        if num_cached_tokens is not None:
            request.num_cached_tokens = num_cached_tokens
        request.num_computed_tokens = request.num_prompt_tokens
        request.transition(RequestStatus.WAITING)
        self.waiting.appendleft(request)
        self.kv.cache_full_blocks(request)
        logprob = first_logprob.logprob if first_logprob is not None else None
        top = first_logprob.top_logprobs if first_logprob is not None else None
        self._pending_outputs.append(
            self._append_token(request, first_token_id, logprob, top, self.clock())
        )

    def fail_remote_prefill(self, request_id: str) -> None:
        """The remote prefill failed: compute the prompt here, into the reserved blocks."""
        request = self._pop_remote(request_id)
        # The prefix hit kept at reservation stays: only the rest is recomputed (never
        # into blocks other requests may share).
        request.transition(RequestStatus.WAITING)
        self.waiting.appendleft(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request as aborted and free its blocks; None if unknown or finished.

        A finished prefill_only request whose KV send is in flight is not aborted here: its
        blocks are released when the connector reports the send done (or failed).
        """
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return make_output(request)

    def finish_sends(self, request_ids: Iterable[str]) -> None:
        """The connector finished reading these requests' blocks: free them.

        A send may be reported done before the request itself finished (within the step
        that started it); its blocks are then freed as soon as it finishes.
        """
        for request_id in request_ids:
            request = self.sending.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
                del self.requests[request_id]
                continue
            request = self.requests.get(request_id)
            if request is not None and request.kv_send_scheduled:
                request.kv_send_done = True

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        if self._scheduled:
            raise RuntimeError("schedule() called twice without update_from_output()")
        budget = self.max_num_batched_tokens
        num_tokens: dict[str, int] = {}
        scheduled: list[Request] = []
        preempted = False

        decodes = [r for r in self.running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_uncomputed_tokens, budget)
            while self.kv.allocate_slots(request, n) is None:
                victim = self._newest_unscheduled(num_tokens)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                num_tokens[request.request_id] = n
                scheduled.append(request)
                budget -= n

        if not preempted:
            budget = self._admit_waiting(budget, num_tokens, scheduled)

        chunks: list[ScheduledChunk] = []
        sends: list[PendingSend] = []
        for request in scheduled:
            n = num_tokens[request.request_id]
            start = request.num_computed_tokens
            end = start + n
            sample = end == request.num_tokens
            chunk = ScheduledChunk(
                request_id=request.request_id,
                token_ids=request.tokens_slice(start, end),
                start_position=start,
                block_ids=list(request.block_ids),
                window_block_ids=(
                    list(request.window_block_ids) if self.kv.window is not None else None
                ),
                sample=sample,
                sampling_params=request.params,
                num_output_tokens=request.num_output_tokens,
                history=(
                    (request.prompt_token_ids, request.output_token_ids)
                    if request.params.needs_history
                    else None
                ),
            )
            chunks.append(chunk)
            if request.prefill_only and self.has_kv_connector:
                send = self._announce_blocks(request, end, sample)
                if send is not None:
                    sends.append(send)
            if start < request.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(end, request.num_prompt_tokens) - start
            request.num_computed_tokens = end
            self._scheduled.append((request, chunk))

        left, self._left_ids = self._left_ids, []
        cancels = [PendingSend(rid, final=False, cancel=True) for rid in self._cancelled_sends]
        self._cancelled_sends = []
        return SchedulerOutput(
            chunks=chunks,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            kv_sends=cancels + sends,
            finished_request_ids=left,
        )

    def _announce_blocks(self, request: Request, end: int, final: bool) -> PendingSend | None:
        """The send of the blocks a prefill chunk ending at token ``end`` completes: every
        full block not announced before (prefix-cache hits included), and on the final
        chunk the last, partial one. None when the chunk completes no new block, or when
        the request's transfer already ended (it failed: nothing more is sent)."""
        if request.kv_send_done:
            return None
        total = self.kv.num_blocks_for(request.num_prompt_tokens)
        complete = total if final else min(end // self.kv.block_size, total)
        announced = self._blocks_announced.get(request.request_id, 0)
        if complete <= announced:
            return None
        request.kv_send_scheduled = True
        self._blocks_announced[request.request_id] = complete
        return PendingSend(
            request.request_id,
            list(request.block_ids[announced:complete]),
            request.num_prompt_tokens,
            block_offset=announced,
            final=final,
        )

    def _admit_waiting(
        self, budget: int, num_tokens: dict[str, int], scheduled: list[Request]
    ) -> int:
        """Admit waiting requests while budget, seats and blocks allow.

        Requests that already hold blocks (their prompt KV arrived from a prefill replica,
        or a failed one is recomputed into its reservation) go first: they cannot be
        starved by a queue head that waits for exactly the blocks they hold. The others are
        first come, first served; a head that does not fit blocks those behind it.
        """
        holders = [r for r in self.waiting if r.block_ids]
        for request in holders + [r for r in self.waiting if not r.block_ids]:
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            looked_up = not request.block_ids and self.kv.enable_prefix_caching
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            n = min(request.num_uncomputed_tokens - num_hit_tokens, budget)
            if self.kv.allocate_slots(request, n, hits) is None:
                if request.block_ids:
                    continue  # a holder that needs one more block; try the next holder
                break
            if looked_up:
                self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            self.waiting.remove(request)
            first_admission = request.status is RequestStatus.WAITING
            if first_admission and not request.num_preemptions and hits:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens += num_hit_tokens
            request.transition(RequestStatus.RUNNING)
            self.running.append(request)
            num_tokens[request.request_id] = n
            scheduled.append(request)
            budget -= n
        return budget

    def _newest_unscheduled(self, scheduled: dict[str, int]) -> Request:
        """The preemption victim: the newest running request not scheduled this step,
        preferring one whose KV is not being sent (that one is aborted, and its blocks
        come back only once the connector confirms, not in this step)."""
        candidates = [r for r in reversed(self.running) if r.request_id not in scheduled]
        for request in candidates:
            if not (request.kv_send_scheduled and not request.kv_send_done):
                return request
        if candidates:
            return candidates[0]
        raise AssertionError("no preemptable request although the current one is running")

    def _preempt(self, request: Request) -> None:
        if request.kv_send_scheduled and not request.kv_send_done:
            # Its blocks are being sent: abort it (see the module docstring), which cancels
            # the transfer; the blocks come back once the connector confirms.
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.append(make_output(request))
            return
        self._blocks_announced.pop(request.request_id, None)
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.transition(RequestStatus.PREEMPTED)
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        self._left_ids.append(request.request_id)

    # ------------------------------------------------------------------ update
    def update_from_output(self, sampled: Mapping[str, SampledTokenLike]) -> list[RequestOutput]:
        """Apply the step's sampled tokens; return one output per request that got a token."""
        outputs, self._pending_outputs = self._pending_outputs, []
        now = self.clock()
        for request, chunk in self._scheduled:
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            self.kv.cache_full_blocks(request)
            if not chunk.sample:
                continue
            token = sampled.get(request.request_id)
            if token is None:
                raise RuntimeError(f"model runner returned no token for {request.request_id}")
            outputs.append(
                self._append_token(request, token.token_id, token.logprob, token.top_logprobs, now)
            )
        self._scheduled = []
        return outputs

    def _append_token(
        self,
        request: Request,
        token_id: int,
        logprob: float | None,
        top_logprobs: list[tuple[int, float]] | None,
        now: float,
    ) -> RequestOutput:
        request.output_token_ids.append(token_id)
        self.num_generated_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
        params = request.params
        if params.logprobs is not None and logprob is not None:
            top = top_logprobs[: params.logprobs] if top_logprobs is not None else None
            request.output_logprobs.append(TokenLogprob(token_id, logprob, top))
        status = check_stop(request, token_id, self.max_model_len)
        if status is None and request.prefill_only:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(request, status)
        return make_output(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        previous = request.status
        request.transition(status)
        if previous is RequestStatus.RUNNING:
            self.running.remove(request)
        elif previous is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.remote[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
        self._left_ids.append(request.request_id)
        flush = getattr(request.detokenizer, "flush", None)
        if flush is not None:
            flush()  # emit bytes held back for an incomplete character
        if request.request_id in self._external_loads:
            self._external_loads.discard(request.request_id)
            assert self.kv_connector is not None
            self.kv_connector.request_finished(request.request_id)
        announced = self._blocks_announced.pop(request.request_id, 0)
        if request.kv_send_scheduled and not request.kv_send_done:
            # The connector may be reading these blocks; it reports every send it was given
            # (done, failed or cancelled), and finish_sends() frees them then.
            if announced < self.kv.num_blocks_for(request.num_prompt_tokens):
                self._cancelled_sends.append(request.request_id)  # left before its final chunk
            self.sending[request.request_id] = request
            return
        self.kv.free(request)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ helpers
    def _register(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request

    def _remote_request(self, request_id: str) -> Request:
        request = self.remote.get(request_id)
        if request is None:
            raise ValueError(f"request_id {request_id!r} is not waiting for remote KV")
        return request

    def _pop_remote(self, request_id: str) -> Request:
        request = self._remote_request(request_id)
        del self.remote[request_id]
        return request

    def check_integrity(self) -> None:
        """Queues agree with request states, and the KV pool with the block tables."""
        expected = {
            "running": (self.running, {RequestStatus.RUNNING}),
            "waiting": (self.waiting, {RequestStatus.WAITING, RequestStatus.PREEMPTED}),
            "remote": (self.remote.values(), {RequestStatus.WAITING_FOR_REMOTE_KV}),
            "sending": (self.sending.values(), set(_FINISHED_STATES)),
        }
        for queue_name, (queue, allowed) in expected.items():
            for r in queue:
                if r.status not in allowed:
                    raise AssertionError(f"{r.request_id} is {r.status.name} in {queue_name}")
        num_queued = len(self.running) + len(self.waiting) + len(self.remote) + len(self.sending)
        if num_queued != len(self.requests):
            raise AssertionError(f"{num_queued} queued requests but {len(self.requests)} known")
        self.kv.check_integrity(self.requests.values())
