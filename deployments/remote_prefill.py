"""Remote prefill, decode side: the one owner of a decode replica's half of the hand-off.

``RemotePrefill`` marks the request for a remote load on the engine's KV connector
(``DecodeKVConnector``, or ``TPDecodeConnector`` for a tensor-parallel replica), reserves the
prompt's KV blocks in the engine (whose scheduler tells the connector where the KV goes),
opens the transfer through the connector, calls the prefill pool, waits for the KV, hands it
to the engine with the first token, and falls back to a local recompute on any failure.
An engine that keeps its window layers' KV in a pool of their own (``window_handoff.py``) is
reserved for the first decoded token's window there, and that pool gets a target of its own
per rank (``PrefillRequest.window_kv_targets``).
``DecodeServer`` uses it for every request its policy sends to the prefill pool. The
invariant it keeps: when it returns (or is cancelled) no prefill peer is still writing into
the request's blocks, and the engine request is either decoding, recomputing locally, or
aborted (its blocks freed), never left waiting for KV that will not come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, Protocol

from pdserve.deployments import tracing
from pdserve.deployments.load import RateMeter
from pdserve.deployments.messages import GenerateRequest, PrefillRequest, PrefillResponse
from pdserve.deployments.metrics import ServingMetrics
from pdserve.deployments.policy import RemotePrefillEstimator
from pdserve.deployments.tp_kv import TPDecodeConnector
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.decode_connector import DecodeKVConnector
from pdserve.kvtransfer.types import KVTarget

logger = logging.getLogger("ray.serve")

# The decode replica's KV connector, as the engine was given it.
DecodeConnector = DecodeKVConnector | TPDecodeConnector

# Extra time past the KV deadline granted to the prefill call's answer (its own result
# wait is bounded by the same deadline).
PREFILL_CALL_GRACE_S = 2.0


class PrefillClient(Protocol):
    """Calls the prefill pool; cancelling the awaiting task cancels the call."""

    async def prefill(self, request: PrefillRequest) -> PrefillResponse: ...


class ServePrefillClient:
    """``PrefillClient`` over a Serve ``DeploymentHandle`` to ``PrefillServer``."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    async def warm_up(self) -> None:
        """One cheap call through the handle (``handle_warmup``)."""
        await self._handle.actor_name.remote()

    async def prefill(self, request: PrefillRequest) -> PrefillResponse:
        response = self._handle.prefill.remote(request)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()
            raise


def _skipped_bytes(targets: tuple[KVTarget, ...]) -> int:
    """Bytes of one pool's blocks before its targets' ``first_block``: every layer of the
    pool, each KV head once (the canonical holder of a head replicated across ranks)."""
    if not targets or not targets[0].first_block:
        return 0
    canonical = [t for t in targets if t.layout.kv_head_replica == 0]
    per_block = sum(t.layout.block_bytes() for t in canonical) * targets[0].layout.num_layers
    return targets[0].first_block * per_block


class RemotePrefill:
    """Runs remote prefills for one decode replica: its engine (an ``AsyncLLMEngine``), the
    KV connector the engine was built with, and the client of the prefill pool."""

    def __init__(
        self,
        *,
        engine: Any,
        connector: DecodeConnector,
        client: PrefillClient,
        estimate: RemotePrefillEstimator,
        timeout_s: float,
        model_name: str,
        metrics: ServingMetrics,
    ) -> None:
        self.engine = engine
        self.connector = connector
        self.client = client
        self.estimate = estimate
        self.timeout_s = timeout_s
        self.model_name = model_name
        self.metrics = metrics
        self.fallbacks = 0
        self.kv_refused = RateMeter()  # remote prefills refused for lack of KV room
        # Where a request's prompt really got prefilled when it differs from "remote"
        # (no room to reserve -> "local"; the remote prefill failed -> "fallback").
        self._placed: dict[str, str] = {}

    # ------------------------------------------------------------------ the request path
    async def outputs(
        self, req: GenerateRequest, params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's engine outputs, its prompt prefilled remotely (or locally when
        the pool has no room, or after a failure)."""
        rid, ids = req.request_id, req.prompt_token_ids
        windowed = self._receives_window_pool()
        self.connector.register_load(rid)
        try:
            if windowed:  # the engine reserves only the first decoded token's window there
                blocks = await self.engine.reserve_remote_prefill(
                    rid, ids, params, receives_window_pool=True
                )
            else:
                blocks = await self.engine.reserve_remote_prefill(rid, ids, params)
        finally:
            self.connector.unregister_load(rid)  # the scheduler took it over, or never will
        if blocks is None:
            # No room for the whole prompt now: the local scheduler queues it instead.
            self._placed[rid] = "local"
            self.kv_refused.add(1)  # the decode autoscaler sees the missing KV room
            async with contextlib.aclosing(self.engine.generate(rid, ids, params)) as local:
                async for out in local:
                    yield out
            return
        # The deadline: the prefill work queued ahead of this prompt and its own, at the
        # prefill engine's measured rate, plus ``timeout_s`` of slack. A prefill that is
        # merely queued behind others is not a failure, and recomputing it here would stall
        # every running decode (the very stall disaggregation exists to avoid). A dead
        # replica fails its call at once; a stuck one or a broken transfer still falls back
        # once the slack is spent. (Not the full prediction: its overhead term grows with
        # every timed-out call, and so would the time to detect a stuck replica.)
        deadline = time.time() + self.estimate.compute_s(len(ids)) + self.timeout_s
        try:
            targets = self.connector.expect(rid, deadline)
            window_targets = await self._expect_window(rid, deadline) if windowed else ()
        except BaseException:
            await asyncio.to_thread(self.connector.cancel, rid)
            await self.engine.abort(rid)
            raise
        self._count_skipped(targets, window_targets)
        handoff = asyncio.create_task(self._handoff(req, targets, window_targets))
        stream = self.engine.stream(rid)
        try:
            async for out in stream:
                yield out
        finally:
            # Order matters: stop the prefill call and fence the peer before the engine
            # may free (and reuse) the blocks the peer writes into.
            if not handoff.done():
                handoff.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await handoff
            await asyncio.to_thread(self.connector.cancel, rid)
            await stream.aclose()

    def _receives_window_pool(self) -> bool:
        """Whether the engine keeps a window pool its connector fills (every rank's, under
        tensor parallelism)."""
        return self.connector.receives_window_pool

    async def _expect_window(self, rid: str, deadline: float) -> tuple[KVTarget, ...]:
        """The window pool's targets of a reserved request (one per rank, as the full
        pool's): the blocks of the first decoded token's window (past any prefix hit), the
        only window-layer KV the decode needs."""
        first, blocks = await self.engine.remote_window_blocks(rid)
        if isinstance(self.connector, TPDecodeConnector):
            return self.connector.expect_window(rid, first, blocks, deadline)
        return (self.connector.expect_window(rid, first, blocks, deadline),)

    async def _handoff(
        self,
        req: GenerateRequest,
        targets: tuple[KVTarget, ...],
        window_targets: tuple[KVTarget, ...] = (),
    ) -> None:
        """Run the remote prefill and hand its KV to the engine, or fall back to local."""
        rid, n = req.request_id, len(req.prompt_token_ids)
        deadline = targets[0].deadline  # the same on every rank
        began = time.perf_counter()
        ahead = self.estimate.started(n)
        try:
            with tracing.span("prefill_remote", self.model_name) as span:
                try:
                    response = await asyncio.wait_for(
                        self.client.prefill(
                            PrefillRequest(
                                request_id=rid,
                                prompt_token_ids=req.prompt_token_ids,
                                sampling=req.sampling,
                                kv_targets=targets,
                                window_kv_targets=window_targets,
                                trace_carrier=tracing.inject(),
                            )
                        ),
                        timeout=max(0.0, deadline - time.time()) + PREFILL_CALL_GRACE_S,
                    )
                    result = await asyncio.to_thread(self.connector.wait, rid, deadline)
                    end_ns = time.time_ns()
                    tracing.record_span(
                        "kv_transfer",
                        self.model_name,
                        start_ns=end_ns - int(result.seconds * 1e9),
                        end_ns=end_ns,
                        attributes={
                            "pdserve.kv_transfer.bytes": result.bytes,
                            "pdserve.kv_transfer.transport": result.transport,
                        },
                    )
                    first = response.first_logprobs
                    await self.engine.complete_remote_prefill(
                        rid,
                        response.first_token_id,
                        first.to_engine() if first else None,
                        num_cached_tokens=response.num_cached_tokens,
                    )
                    self.estimate.observe(
                        n,
                        time.perf_counter() - began,
                        response.prefill_tokens_per_s,
                        ahead,
                        response.replica,
                    )
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # noqa: BLE001 - every failure falls back to local
                    span.set_attribute("pdserve.prefill.fallback", type(err).__name__)
                    await self._fall_back(rid, n, began, ahead, err)
        finally:
            self.estimate.finished(n)

    async def _fall_back(self, rid: str, n: int, began: float, ahead: int, err: Exception) -> None:
        logger.warning(
            "remote prefill of %s failed (%s: %s); recomputing locally",
            rid,
            type(err).__name__,
            err,
        )
        await asyncio.to_thread(self.connector.cancel, rid)
        # Count the failed attempt's time so a dead or slow pool stops attracting requests.
        self.estimate.observe(n, time.perf_counter() - began, 0.0, ahead)
        self.fallbacks += 1
        self._placed[rid] = "fallback"
        self.metrics.prefill_fallbacks.inc()
        try:
            await self.engine.fail_remote_prefill(rid)
        except Exception:  # noqa: BLE001 - e.g. the request was aborted meanwhile
            logger.exception("local recompute of %s could not start; aborting it", rid)
            await self.engine.abort(rid)  # ends the stream instead of leaving it waiting

    def _count_skipped(
        self, targets: tuple[KVTarget, ...], window_targets: tuple[KVTarget, ...] = ()
    ) -> None:
        """What the hand-off need not move: the prefix blocks this replica's cache already
        holds (on every layer), and with a window pool the window layers' blocks before the
        first decoded token's window (``first_block`` of each pool's targets). Bytes count
        every rank's heads once."""
        skipped = targets[0].first_block
        skipped_bytes = _skipped_bytes(targets) + _skipped_bytes(window_targets)
        if skipped:
            self.metrics.kv_transfer_skipped_blocks.inc(skipped)
        if skipped_bytes:
            self.metrics.kv_transfer_skipped_bytes.inc(skipped_bytes)

    # ------------------------------------------------------------------ bookkeeping
    def location(self, request_id: str, planned: str) -> str:
        """Where the request's prompt was really prefilled ("local", "remote", "fallback")."""
        return self._placed.get(request_id, planned)

    def forget(self, request_id: str) -> None:
        """The request's stream ended: drop what was noted about it."""
        self._placed.pop(request_id, None)

    def pending(self) -> list[str]:
        """Request ids whose KV is still expected (for leak checks)."""
        return self.connector.pending()

    def close(self) -> None:
        """Stop receiving KV: drop every prefill peer and fail what is still expected."""
        self.connector.close()
