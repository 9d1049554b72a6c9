"""Serve request routers for the two pools: TTFT-aware for prefill, KV-aware for decode.

Replicas publish ``ReplicaStats`` from ``record_routing_stats()``; Serve's controller hands
them to every router as ``RunningReplica.routing_stats``. Those numbers lag by up to a stats
period, so each router also counts what it routed itself and has not seen complete, and
uses the larger of the two (a lower bound on the replica's true queue that stays correct
when several routers share a pool).

The scoring functions are pure (``predict_prefill_ttft_s``, ``decode_load_score``) and the
``rank_*`` helpers take any objects with ``replica_id`` and ``routing_stats``, so they are
unit-tested with fakes, and the per-router books are ``InflightLoad``; the ``RequestRouter``
subclasses only glue them to Serve (the simulator in ``pdserve.sim`` calls the same code).
With ``prefix_aware`` (the default) both routers also weigh the prompt blocks each replica
holds (``prefix_index``, ``prefix_routing``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from pydantic import ValidationError
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pdserve.deployments.handoff_bytes import handoff_bytes, transfer_s
from pdserve.deployments.messages import GenerateRequest, PrefillRequest, ReplicaStats
from pdserve.deployments.prefix_index import prompt_block_hashes
from pdserve.deployments.prefix_routing import (
    AffinityParams,
    PrefixRoutingState,
    rank_decode_prefix,
    rank_prefill_prefix,
)

logger = logging.getLogger("ray.serve")


class ReplicaView(Protocol):
    """What the ranking needs from a replica (``RunningReplica`` satisfies it)."""

    @property
    def replica_id(self) -> Any: ...

    @property
    def routing_stats(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class PrefillRouterParams:
    default_prefill_tokens_per_s: float = 2000.0
    transfer_bytes_per_s: float = 1.0e9
    kv_bytes_per_token: int = 0  # 0 = use the replica's reported value


@dataclass(frozen=True)
class DecodeRouterParams:
    kv_weight: float = 1.0
    batch_weight: float = 1.0


def parse_stats(raw: dict[str, Any] | None) -> ReplicaStats | None:
    """Routing stats as published by a replica; None when missing or malformed."""
    if not raw:
        return None
    try:
        return ReplicaStats.model_validate(raw)
    except ValidationError:
        logger.warning("ignoring malformed routing stats: %r", raw)
        return None


class PrefillTerms(NamedTuple):
    """What a replica's report contributes to its predicted TTFT, whatever the prompt:
    worked out once per report (the simulator ranks a 51-replica pool for each of a day's
    650k prompts; Serve's router once per request)."""

    queued_tokens: int
    tokens_per_s: float
    kv_bytes_per_token: int  # of the layers that hand off every token (all, without a window pool)
    transfer_bytes_per_s: float
    # A window pool: its layers hand off only the first decoded token's window (handoff_bytes).
    window_kv_bytes_per_token: int = 0
    kv_window: int = 0
    block_size: int = 16


def prefill_terms(stats: ReplicaStats | None, p: PrefillRouterParams) -> PrefillTerms:
    """A configured ``kv_bytes_per_token`` counts every token on every layer; otherwise the
    replica's report splits its window layers off (``ReplicaStats.window_kv_bytes_per_token``)."""
    queued = stats.queued_prefill_tokens if stats else 0
    rate = (stats.prefill_tokens_per_s if stats else 0.0) or p.default_prefill_tokens_per_s
    if p.kv_bytes_per_token or stats is None:
        return PrefillTerms(queued, rate, p.kv_bytes_per_token, p.transfer_bytes_per_s)
    window_bytes = stats.window_kv_bytes_per_token if stats.kv_window else 0
    return PrefillTerms(
        queued,
        rate,
        max(0, stats.kv_bytes_per_token - window_bytes),
        p.transfer_bytes_per_s,
        window_bytes,
        stats.kv_window,
        stats.block_size,
    )


def predict_prefill_ttft_s(
    stats: ReplicaStats | None, inflight_tokens: int, prompt_tokens: int, p: PrefillRouterParams
) -> float:
    """Queue wait + this prompt's compute + the KV transfer, in seconds."""
    return predict_from_terms(prefill_terms(stats, p), inflight_tokens, prompt_tokens)


def predict_from_terms(t: PrefillTerms, inflight_tokens: int, prompt_tokens: int) -> float:
    """``predict_prefill_ttft_s`` from a report's ``PrefillTerms`` (``rank_prefill_terms``
    has the same arithmetic inline, for speed; the tests hold the two equal)."""
    queued = max(t.queued_tokens, inflight_tokens)
    return (queued + prompt_tokens) / t.tokens_per_s + transfer_s(t, prompt_tokens, prompt_tokens)


def decode_load_score(
    stats: ReplicaStats | None, inflight: int, blocks_needed: int, p: DecodeRouterParams
) -> tuple[bool, float]:
    """(fits, score): lower score is better; ``fits`` is False when the request's blocks
    do not fit in the replica's free KV blocks right now."""
    if stats is None:
        # Unknown replica (just started): it has the whole pool free and an empty batch.
        return True, p.batch_weight * inflight
    batch = max(stats.num_running + stats.num_waiting + stats.num_waiting_remote_kv, inflight)
    total = max(stats.num_total_blocks, 1)
    used = total - stats.num_free_blocks
    kv_after = (used + blocks_needed) / total
    score = p.kv_weight * kv_after + p.batch_weight * batch / max(stats.max_num_seqs, 1)
    return stats.num_free_blocks >= blocks_needed, score


def rank_prefill(
    replicas: Sequence[ReplicaView],
    prompt_tokens: int,
    inflight_tokens: dict[Any, int],
    p: PrefillRouterParams,
) -> list[list[Any]]:
    """Singleton tiers, lowest predicted TTFT first (ties keep the input order)."""
    parsed = [(r, parse_stats(r.routing_stats)) for r in replicas]
    return rank_prefill_stats(parsed, prompt_tokens, inflight_tokens, p)


def rank_prefill_stats(
    replicas: Sequence[tuple[Any, ReplicaStats | None]],
    prompt_tokens: int,
    inflight_tokens: dict[Any, int],
    p: PrefillRouterParams,
) -> list[list[Any]]:
    """``rank_prefill`` over (replica, already parsed stats) pairs."""
    terms = [(r, prefill_terms(stats, p)) for r, stats in replicas]
    return rank_prefill_terms(terms, prompt_tokens, inflight_tokens)


def rank_prefill_terms(
    replicas: Sequence[tuple[Any, PrefillTerms]],
    prompt_tokens: int,
    inflight_tokens: dict[Any, int],
) -> list[list[Any]]:
    """``rank_prefill`` over (replica, ``prefill_terms`` of its report) pairs: the simulator
    works each published report out once, not once per request."""
    # predict_from_terms inline, in the same order of operations (so the same floats), and
    # (score, index) pairs that sort by score, ties in input order, with no key function.
    get = inflight_tokens.get
    n = prompt_tokens
    scored: list[tuple[float, int]] = []
    append = scored.append
    for i, (r, (queued, rate, bytes_per_token, bandwidth, window_bytes, window, bs)) in enumerate(
        replicas
    ):
        inflight = get(r.replica_id, 0)
        ahead = inflight if inflight > queued else queued  # max(), without the call
        if window_bytes:
            moved = handoff_bytes(n, n, bytes_per_token, window_bytes, window, bs)
        else:
            moved = n * bytes_per_token
        append(((ahead + n) / rate + moved / bandwidth, i))
    scored.sort()
    return [[replicas[i][0]] for _, i in scored]


def rank_decode(
    replicas: Sequence[ReplicaView],
    blocks_needed: int,
    inflight: dict[Any, int],
    p: DecodeRouterParams,
) -> list[list[Any]]:
    """Singleton tiers: replicas where the request fits first, each group by load score."""
    parsed = [(r, parse_stats(r.routing_stats)) for r in replicas]
    return rank_decode_stats(parsed, blocks_needed, inflight, p)


def rank_decode_stats(
    replicas: Sequence[tuple[Any, ReplicaStats | None]],
    blocks_needed: int,
    inflight: dict[Any, int],
    p: DecodeRouterParams,
) -> list[list[Any]]:
    """``rank_decode`` over (replica, already parsed stats) pairs."""
    terms = [(r, decode_terms(stats)) for r, stats in replicas]
    return rank_decode_terms(terms, blocks_needed, inflight, p)


class DecodeTerms(NamedTuple):
    """What a decode replica's report contributes to its load score, whatever the request
    (``decode_load_score``), worked out once per report."""

    batch: int
    free_blocks: int
    total_blocks: int  # at least 1
    max_num_seqs: int  # at least 1


def decode_terms(stats: ReplicaStats | None) -> DecodeTerms | None:
    """None for a replica that has not reported yet."""
    if stats is None:
        return None
    return DecodeTerms(
        stats.num_running + stats.num_waiting + stats.num_waiting_remote_kv,
        stats.num_free_blocks,
        max(stats.num_total_blocks, 1),
        max(stats.max_num_seqs, 1),
    )


def rank_decode_terms(
    replicas: Sequence[tuple[Any, DecodeTerms | None]],
    blocks_needed: int,
    inflight: dict[Any, int],
    p: DecodeRouterParams,
) -> list[list[Any]]:
    """``rank_decode`` over (replica, ``decode_terms`` of its report) pairs: replicas where
    the request fits first, each group by ``decode_load_score`` (the same arithmetic, inline
    for speed; the tests hold the two equal), ties in input order."""
    get = inflight.get
    kv_weight, batch_weight = p.kv_weight, p.batch_weight
    scored: list[tuple[bool, float, int]] = []
    append = scored.append
    for i, (r, t) in enumerate(replicas):
        sent = get(r.replica_id, 0)
        if t is None:
            append((False, batch_weight * sent, i))
            continue
        batch, free, total, seqs = t
        if sent > batch:
            batch = sent
        kv_after = (total - free + blocks_needed) / total
        append((free < blocks_needed, kv_weight * kv_after + batch_weight * batch / seqs, i))
    scored.sort()
    return [[replicas[i][0]] for *_, i in scored]


def _request_arg(pending_request: PendingRequest | None) -> Any:
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]


class InflightLoad:
    """Per replica, the load (a weight per request) one router sent and has not seen
    complete. Plain Python, so the cluster simulator (``pdserve.sim``) keeps the very same
    books as the Serve routers.

    One request id may have several calls in flight: Serve names a call by the request it
    is made from, so the choices of one request (``n`` > 1) share it, as do a decode
    replica's prefill calls for them. Each call is booked, and completing one takes off
    the call booked on that replica (the oldest, when the replica is not given; nothing
    when none is booked there: Serve also reports the end of a call its replica rejected)."""

    def __init__(self) -> None:
        self.by_replica: dict[Any, int] = {}
        self._by_request: dict[str, list[tuple[Any, int]]] = {}

    def routed(self, request_id: str, replica_id: Any, weight: int) -> None:
        self._by_request.setdefault(request_id, []).append((replica_id, weight))
        self.by_replica[replica_id] = self.by_replica.get(replica_id, 0) + weight

    def completed(self, request_id: str, replica_id: Any = None) -> None:
        calls = self._by_request.get(request_id)
        if not calls:
            return
        if replica_id is None:
            i = 0
        else:  # a call Serve never booked here (one its replica rejected) takes off nothing
            i = next((i for i, (rid, _) in enumerate(calls) if rid == replica_id), -1)
            if i < 0:
                return
        rid, weight = calls.pop(i)
        if not calls:
            del self._by_request[request_id]
        left = self.by_replica.get(rid, 0) - weight
        if left > 0:
            self.by_replica[rid] = left
        else:
            self.by_replica.pop(rid, None)

    def replica_died(self, replica_id: Any) -> None:
        self.by_replica.pop(replica_id, None)


def decode_blocks_needed(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a request holds at its longest (prompt + every output token)."""
    return -(-(prompt_tokens + max_tokens) // block_size)


class _TrackingRouter(RequestRouter):
    """Counts, per replica, the load this router sent that has not completed yet."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._load = InflightLoad()
        self._inflight: dict[ReplicaID, int] = self._load.by_replica

    def _weight(self, pending_request: PendingRequest) -> int:
        return 1

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        weight = self._weight(pending_request)
        self._load.routed(pending_request.metadata.internal_request_id, replica_id, weight)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._load.completed(internal_request_id, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._load.replica_died(replica_id)


class _PrefixRouter(_TrackingRouter):
    """A tracking router that also keeps a ``PrefixRoutingState`` (built in initialize_state)."""

    pool = "decode"

    def _init_prefix(
        self, prefix_aware: bool, history_ttl_s: float, affinity: AffinityParams
    ) -> None:
        self._prefix = PrefixRoutingState(
            self.pool, prefix_aware=prefix_aware, history_ttl_s=history_ttl_s, affinity=affinity
        )

    def _prefix_state(self) -> PrefixRoutingState:
        if getattr(self, "_prefix", None) is None:
            self._init_prefix(True, 30.0, AffinityParams())
        return self._prefix

    def _prompt_hashes(self, pending_request: PendingRequest, block_size: int) -> list[int]:
        req = _request_arg(pending_request)
        if not isinstance(req, GenerateRequest | PrefillRequest):
            return []
        return prompt_block_hashes(req.prompt_token_ids, block_size)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        state = self._prefix_state()
        if state.enabled:
            hashes = self._prompt_hashes(pending_request, self._last_block_size)
            state.routed(pending_request, replica_id, hashes)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._prefix_state().index.forget(replica_id)

    _last_block_size = 16  # the block size the latest reports gave (the pool's)


class PrefillRequestRouter(_PrefixRouter):
    """Routes ``PrefillRequest``s to the replica with the smallest predicted TTFT (counting
    only the prompt tokens each replica lacks and the blocks the decode side lacks)."""

    pool = "prefill"

    def initialize_state(
        self, prefix_aware: bool = True, history_ttl_s: float = 30.0, **kwargs: Any
    ) -> None:
        self._params = PrefillRouterParams(**kwargs)
        self._init_prefix(prefix_aware, history_ttl_s, AffinityParams())

    def _weight(self, pending_request: PendingRequest) -> int:
        req = _request_arg(pending_request)
        return len(req.prompt_token_ids) if isinstance(req, PrefillRequest) else 1

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Back off between rounds when every replica is full (no tight loop).
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        req = _request_arg(pending_request)
        tokens = len(req.prompt_token_ids) if isinstance(req, PrefillRequest) else 0
        params = getattr(self, "_params", PrefillRouterParams())
        state = self._prefix_state()
        if not state.enabled or not isinstance(req, PrefillRequest):
            return rank_prefill(candidate_replicas, tokens, self._inflight, params)
        parsed = [(r, parse_stats(r.routing_stats)) for r in candidate_replicas]
        target = req.kv_targets[0]
        bs = self._last_block_size = target.layout.block_size
        hashes = prompt_block_hashes(req.prompt_token_ids, bs)
        cached = {rid: n * bs for rid, n in state.matched(parsed, hashes).items()}
        terms = [(r, prefill_terms(stats, params)) for r, stats in parsed]
        transfer_tokens = max(1, tokens - target.first_block * bs)
        ranked, reason = rank_prefill_prefix(terms, tokens, cached, transfer_tokens, self._inflight)
        state.chose(pending_request, reason)
        return ranked


class DecodeRequestRouter(_PrefixRouter):
    """Routes ``GenerateRequest``s to the replica with KV headroom and the lightest batch,
    preferring one that holds the prompt's prefix (``prefix_routing.rank_decode_prefix``)."""

    pool = "decode"

    def initialize_state(
        self,
        prefix_aware: bool = True,
        history_ttl_s: float = 30.0,
        prefix_weight: float = 1.0,
        max_imbalance: int = 4,
        **kwargs: Any,
    ) -> None:
        self._params = DecodeRouterParams(**kwargs)
        self._init_prefix(prefix_aware, history_ttl_s, AffinityParams(prefix_weight, max_imbalance))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        req = _request_arg(pending_request)
        params = getattr(self, "_params", DecodeRouterParams())
        bs = self._last_block_size = _block_size(candidate_replicas)
        blocks_needed = 0
        if isinstance(req, GenerateRequest):
            blocks_needed = decode_blocks_needed(
                len(req.prompt_token_ids), req.sampling.max_tokens, bs
            )
        state = self._prefix_state()
        if not state.enabled or not isinstance(req, GenerateRequest):
            return rank_decode(candidate_replicas, blocks_needed, self._inflight, params)
        parsed = [(r, parse_stats(r.routing_stats)) for r in candidate_replicas]
        hashes = prompt_block_hashes(req.prompt_token_ids, bs)
        matched = state.matched(parsed, hashes)
        terms = [(r, decode_terms(stats)) for r, stats in parsed]
        ranked, reason = rank_decode_prefix(
            terms, blocks_needed, len(hashes), matched, self._inflight, params, state.affinity
        )
        state.chose(pending_request, reason)
        return ranked


def _block_size(replicas: Sequence[ReplicaView]) -> int:
    for r in replicas:
        stats = parse_stats(r.routing_stats)
        if stats is not None:
            return stats.block_size
    return 16
