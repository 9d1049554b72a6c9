"""Prefix-aware ranking for both pools: a replica that holds more of the prompt's blocks
costs less, weighed against its load.

Decode pool (``rank_decode_prefix``): each replica's load score is ``decode_load_score``'s
(KV usage after this request + batch fullness; lower is better), computed with only the
blocks the replica lacks, minus an affinity bonus ``prefix_weight x (held blocks / prompt
blocks)``. With the default weights (1.0 each) holding the whole prompt is worth as much as
a full batch's worth of load. Load and headroom win over affinity: a replica is scored as a
prefix-blind router would score it (no bonus, every block counted as needed) when the
request does not fit its free blocks, when its batch is full, or when it carries more than
``max_imbalance`` requests above the pool's least-loaded replica; so a single hot prefix
spreads once its replica runs ``max_imbalance`` requests ahead of the others.

Prefill pool (``rank_prefill_prefix``): the predicted TTFT already prices the prefix: only
the tokens a replica lacks are computed, and only the blocks the decode side lacks move.

Every ranking also returns its reason, for the routing-decisions metric: ``prefix`` (the
affinity bonus changed the choice), ``load`` (the least-loaded replica won on its own),
``overload`` (a replica holding more of the prompt was passed over for its load or
headroom), ``no_fit`` (no replica has room for the request's blocks now).

Pure functions over the routers' parsed reports, so the simulator ranks with them too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pdserve.deployments.handoff_bytes import transfer_s
from pdserve.deployments.messages import ReplicaStats
from pdserve.deployments.metrics import RoutingDecisions
from pdserve.deployments.prefix_index import PrefixIndex

if TYPE_CHECKING:  # routers imports this module; these are only its report types
    from pdserve.deployments.routers import DecodeRouterParams, DecodeTerms, PrefillTerms

RoutingReason = Literal["prefix", "load", "overload", "no_fit"]


@dataclass(frozen=True)
class AffinityParams:
    """How much a held prefix is worth against load (see the module docstring)."""

    prefix_weight: float = 1.0
    max_imbalance: int = 4

    def __post_init__(self) -> None:
        if self.prefix_weight < 0:
            raise ValueError(f"prefix_weight must be >= 0, got {self.prefix_weight}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")


def rank_decode_prefix(
    replicas: Sequence[tuple[Any, DecodeTerms | None]],
    blocks_needed: int,
    prompt_blocks: int,
    matched: Mapping[Any, int],
    inflight: Mapping[Any, int],
    p: DecodeRouterParams,
    a: AffinityParams,
) -> tuple[list[list[Any]], RoutingReason]:
    """Singleton tiers, best first: replicas where the request fits (counting only the blocks
    each lacks) first, each group by load score minus affinity bonus; ties in input order."""
    if not replicas:
        return [], "no_fit"
    # Per replica: (index, fits, batch, score, blind score, held, full); the blind score is
    # what a prefix-blind router would compute (every block needed), to name the reason.
    rows = []
    for i, (r, t) in enumerate(replicas):
        sent = inflight.get(r.replica_id, 0)
        held = min(matched.get(r.replica_id, 0), blocks_needed)
        if t is None:  # not reported yet: the whole pool free, an empty batch
            load = p.batch_weight * sent
            rows.append((i, True, True, sent, load, load, held, False))
            continue
        batch = max(t.batch, sent)
        used = t.total_blocks - t.free_blocks
        need = blocks_needed - held
        fill = p.batch_weight * batch / t.max_num_seqs
        score = p.kv_weight * (used + need) / t.total_blocks + fill
        blind = p.kv_weight * (used + blocks_needed) / t.total_blocks + fill
        fits = t.free_blocks >= need
        rows.append((i, fits, t.free_blocks >= blocks_needed, batch, score, blind, held,
                     batch >= t.max_num_seqs))  # fmt: skip
    least = min(row[3] for row in rows)
    scored = []
    for i, fits, fits_blind, batch, score, blind, held, full in rows:
        eligible = fits and not full and batch - least <= a.max_imbalance and prompt_blocks > 0
        # An ineligible replica is scored as a blind router would: no credit at all for
        # what it holds (not even the smaller KV need), so load alone decides.
        if eligible:
            score -= a.prefix_weight * held / prompt_blocks
        else:
            score = blind
        scored.append((not fits, score, held, i, (not fits_blind, blind)))
    ranked = sorted(scored)
    by_load = min(scored, key=lambda s: (s[4], s[3]))
    top = ranked[0]
    most_held = max(s[2] for s in scored)
    if top[0]:
        reason: RoutingReason = "no_fit"
    elif top[3] != by_load[3]:
        reason = "prefix"
    elif most_held > top[2]:
        reason = "overload"
    else:
        reason = "load"
    return [[replicas[s[3]][0]] for s in ranked], reason


def rank_prefill_prefix(
    replicas: Sequence[tuple[Any, PrefillTerms]],
    prompt_tokens: int,
    cached_tokens: Mapping[Any, int],
    transfer_tokens: int,
    inflight_tokens: Mapping[Any, int],
) -> tuple[list[list[Any]], RoutingReason]:
    """Singleton tiers, lowest predicted TTFT first: queue wait + the tokens this replica
    lacks + the transfer of ``transfer_tokens`` (the blocks the decode side lacks; a window
    pool's layers move only the window's, ``handoff_bytes.transfer_s``)."""
    if not replicas:
        return [], "no_fit"
    scored = []
    for i, (r, t) in enumerate(replicas):
        ahead = max(t.queued_tokens, inflight_tokens.get(r.replica_id, 0))
        cached = min(cached_tokens.get(r.replica_id, 0), prompt_tokens - 1)
        moving = transfer_s(t, prompt_tokens, transfer_tokens)
        without = (ahead + prompt_tokens) / t.tokens_per_s + moving
        scored.append(((ahead + prompt_tokens - cached) / t.tokens_per_s + moving, without, i))
    ranked = sorted(scored)
    by_load = min(scored, key=lambda s: (s[1], s[2]))
    reason: RoutingReason = "prefix" if ranked[0][2] != by_load[2] else "load"
    return [[replicas[s[2]][0]] for s in ranked], reason


class PrefixRoutingState:
    """A router's prefix-aware part: the index of which replica holds which blocks, the
    affinity parameters, and the decisions metric (recorded when Ray is up)."""

    def __init__(
        self, pool: str, *, prefix_aware: bool, history_ttl_s: float, affinity: AffinityParams
    ) -> None:
        import ray

        self.enabled = prefix_aware
        self.index = PrefixIndex(history_ttl_s=history_ttl_s)
        self.affinity = affinity
        self.decisions = RoutingDecisions(pool, enabled=ray.is_initialized())
        self._reasons: dict[str, str] = {}  # internal request id -> why, until routed

    def matched(
        self, parsed: Sequence[tuple[Any, ReplicaStats | None]], hashes: list[int]
    ) -> dict[Any, int]:
        """Blocks of the chain ``hashes`` each replica holds, after applying its events."""
        for r, stats in parsed:
            if stats is not None and stats.kv_events:
                self.index.apply(r.replica_id, stats.kv_events)
        return {r.replica_id: self.index.matched_blocks(r.replica_id, hashes) for r, _ in parsed}

    def chose(self, pending_request: Any, reason: str) -> None:
        if pending_request is not None:
            self._reasons[pending_request.metadata.internal_request_id] = reason
            while len(self._reasons) > 4096:  # chosen but never routed (cancelled)
                del self._reasons[next(iter(self._reasons))]

    def routed(self, pending_request: Any, replica_id: Any, hashes: list[int]) -> None:
        self.index.routed(replica_id, hashes)
        reason = self._reasons.pop(pending_request.metadata.internal_request_id, None)
        if reason is not None:
            self.decisions.record(reason)
