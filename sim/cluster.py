"""The simulated cluster: an ingress, a decode pool and a prefill pool of ``SimEngine``
replicas, wired by pdserve's LIVE decision code.

Called unchanged, as the Serve app calls it:
- decode routing: ``routers.rank_decode_terms`` (what ``rank_decode`` ranks by) over the
  replicas' published ``ReplicaStats``, each worked out once by ``routers.decode_terms``
  (refreshed every ``router.stats_period_s``, so as stale as in Serve) and the ingress
  router's own ``InflightLoad``;
- local / remote: ``DisaggregationPolicy.decide`` with the decode replica's
  ``LocalLoad`` and its own ``RemotePrefillEstimator`` (started / observe / finished around
  each remote prefill, the deadline of ``RemotePrefill``: predicted compute + timeout);
- prefill routing: ``routers.rank_prefill_terms`` (what ``rank_prefill`` ranks by, each
  report worked out once by ``routers.prefill_terms``) with each decode replica's own books;
- load reports: ``load.replica_stats`` and ``RateMeter``;
- prefix-aware routing (``router.prefix_aware``): ``prefix_routing.rank_decode_prefix`` and
  ``rank_prefill_prefix`` over each pool's live ``PrefixIndex``, fed the KV events the
  replicas' prefix caches (``prefix.SimPrefixCache``) publish with their reports; the
  local/remote policy gets the decode replica's own hit, a prefill computes only what its
  replica lacks and only the blocks the decode replica lacks cross the link (requests
  without ``block_hashes`` share no prefix);
- autoscaling: ``SimAutoscaler`` (``autoscaler.py``);
- admission: an optional ``Admission`` asked after the policy placed the request (the
  decode server's own admission control plugs in here: ``replica.LiveAdmission``); without
  one nothing is shed.

What is modelled, not run: the engines (``SimEngine`` over a cost model), the network
(``SimSettings.rpc_s`` per hop) and the KV transfer (the cost model's transfer time, of
which only the last layer's share shows after the prefill when the link keeps pace).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator, Mapping
from typing import Any

from pdserve.deployments.config import AppConfig, PoolRole
from pdserve.deployments.load import (
    RateMeter,
    replica_stats,
)
from pdserve.deployments.messages import ReplicaStats
from pdserve.deployments.policy import (
    DisaggregationPolicy,
    LocalLoad,
    RemotePrefillEstimator,
)
from pdserve.deployments.prefix_index import PrefixIndex
from pdserve.deployments.prefix_routing import (
    AffinityParams,
    RoutingReason,
    rank_decode_prefix,
    rank_prefill_prefix,
)
from pdserve.deployments.routers import (
    DecodeRouterParams,
    InflightLoad,
    PrefillRouterParams,
    decode_blocks_needed,
    decode_terms,
    prefill_terms,
    rank_decode_terms,
    rank_prefill_terms,
)
from pdserve.sim.autoscaler import SimAutoscaler
from pdserve.sim.config import ROLES, SimSettings
from pdserve.sim.cost import CostModel
from pdserve.sim.engine import SimEngine
from pdserve.sim.events import EventLoop
from pdserve.sim.prefix import SimPrefixCache
from pdserve.sim.replica import (
    Admission,
    AdmissionQuery,
    LiveAdmission,
    RemoteInFlight,
    SimReplica,
)
from pdserve.sim.request import SimRequest
from pdserve.sim.seq import EngineShape, Seq
from pdserve.sim.shared_cpu import HelperThreadsCost, SharedCpuCost, SharedCpuLoad

__all__ = ["Admission", "AdmissionQuery", "LiveAdmission", "SimCluster", "SimReplica"]


class SimCluster:
    def __init__(
        self,
        app: AppConfig,
        prefill_cost: CostModel,
        decode_cost: CostModel,
        settings: SimSettings | None = None,
        admission: Admission | None = None,
        helper_costs: Mapping[PoolRole, CostModel] | None = None,
    ) -> None:
        """``helper_costs``: per pool whose engines add helper threads on the shared CPUs
        (``cpu.helper_threads``), its step profile with the helpers at full speed
        (``shared_cpu.HelperThreadsCost``; needs ``settings.shared_cpu``)."""
        self.app = app
        self.s = settings or SimSettings()
        self.admission = admission
        self.loop = EventLoop()
        self.costs: dict[PoolRole, CostModel] = {"prefill": prefill_cost, "decode": decode_cost}
        shared = self.s.shared_cpu
        self.shared_cpu = (
            SharedCpuLoad(shared, self.loop, self._decode_tokens_per_s, self._decode_steps_per_s)
            if shared
            else None
        )
        if shared is not None and self.shared_cpu is not None:
            for role in shared.roles:
                self.costs[role] = SharedCpuCost(self.costs[role], self.shared_cpu)
        self.helpers: dict[PoolRole, HelperThreadsCost] = {}
        for role, helper in (helper_costs or {}).items():
            if self.shared_cpu is None:
                raise ValueError("helper threads compute on the shared CPUs: set shared_cpu")
            pool = app.pool(role)
            self.helpers[role] = HelperThreadsCost(
                self.costs[role], helper, self.shared_cpu, pool.cpu.helper_min_tokens
            )
            self.costs[role] = self.helpers[role]
        self.pools: dict[PoolRole, list[SimReplica]] = {"prefill": [], "decode": []}
        self.retired: list[SimReplica] = []
        self.ingress_books = InflightLoad()
        self.backlog: deque[SimRequest] = deque()
        r = app.router
        self.prefill_params = PrefillRouterParams(
            default_prefill_tokens_per_s=r.default_prefill_tokens_per_s,
            transfer_bytes_per_s=r.transfer_bytes_per_s,
            kv_bytes_per_token=r.kv_bytes_per_token,
        )
        self.decode_params = DecodeRouterParams(
            kv_weight=r.decode_kv_weight, batch_weight=r.decode_batch_weight
        )
        self.policy = DisaggregationPolicy(app.policy, app.slo, r.default_prefill_tokens_per_s)
        self.affinity = AffinityParams(r.prefix_weight, r.prefix_max_imbalance)
        self.prefix_index = {
            role: PrefixIndex(history_ttl_s=r.prefix_history_ttl_s, clock=lambda: self.loop.now)
            for role in ROLES
        }
        # The prefix-aware routers' decisions by (pool, reason).
        self.prefix_reasons: Counter[tuple[PoolRole, RoutingReason]] = Counter()
        self.kv_transfer_tokens = 0  # prompt tokens whose KV crossed from prefill to decode
        self.shapes = {role: self._shape(role) for role in ROLES}
        self._remote: dict[int, RemoteInFlight] = {}
        # Per remote prefill: (prompt tokens to send, prompt tokens the decode side holds).
        self._transfer: dict[int, tuple[int, int]] = {}
        self._open = 0
        self._publishing = False  # a _publish_all is scheduled
        self._next_id = 0
        self.timeline: list[tuple[float, int, int]] = []
        # Where each request went: (decode replica, prefill replica or None).
        self.routes: dict[int, tuple[str, str | None]] = {}
        self.counts = {"local": 0, "remote": 0, "fallback": 0, "shed": 0, "failed": 0}
        # The live policy's decisions by (location, reason), and the remote ones placed
        # locally after all because the decode replica had no KV room to reserve.
        self.reasons: Counter[tuple[str, str]] = Counter()
        self.kv_refused = 0
        # Per pool, (replica, last report) of the replicas a router may pick: rebuilt only
        # after a report, a replica ready, draining or retired (not once per request).
        self._pairs: dict[PoolRole, list[tuple[SimReplica, ReplicaStats | None]] | None] = {
            "prefill": None,
            "decode": None,
        }
        self._terms: dict[PoolRole, list[tuple[SimReplica, Any]] | None] = {
            "prefill": None,
            "decode": None,
        }
        self._arrivals: Iterator[SimRequest] = iter(())
        self.autoscaler = SimAutoscaler(self)
        for role in ROLES:
            for _ in range(app.pool(role).start_replicas):
                self.start_replica(role, ready_in=0.0)

    # ------------------------------------------------------------------ setup
    def _shape(self, role: PoolRole) -> EngineShape:
        limits = self.app.pool(role).engine
        cost = self.costs[role]
        blocks = limits.num_kv_blocks or max(1, cost.kv_capacity_tokens // limits.block_size)
        return EngineShape(
            limits.max_num_batched_tokens, limits.max_num_seqs, limits.block_size, blocks
        )

    def _decode_tokens_per_s(self) -> float:
        """Output tokens per second the decode pool emits right now."""
        return sum(r.engine.output_rate for r in self.pools["decode"])

    def _decode_steps_per_s(self) -> float:
        """Steps per second that stream tokens in the decode pool right now."""
        return sum(r.engine.step_rate for r in self.pools["decode"])

    def start_replica(self, role: PoolRole, ready_in: float) -> SimReplica:
        self._next_id += 1
        gpus = (
            self.s.gpus_per_prefill_replica if role == "prefill" else self.s.gpus_per_decode_replica
        )
        helper = self.helpers.get(role)
        shared = helper is not None or (
            self.shared_cpu is not None and role in self.shared_cpu.settings.roles
        )
        # The engine's callbacks name the replica built around it just below.
        if role == "prefill":
            engine = SimEngine(
                self.loop,
                self.costs[role],
                self.shapes[role],
                on_finish=lambda seq, t: self._prefill_done(replica, seq, t),
                macro_steps=self.s.macro_steps and not shared,
            )
        else:
            engine = SimEngine(
                self.loop,
                self.costs[role],
                self.shapes[role],
                on_first_token=lambda seq, t: self._first_token(replica, seq, t),
                on_finish=lambda seq, t: self._finished(replica, seq, t),
                macro_steps=self.s.macro_steps and not shared,
                on_output_rate=self.shared_cpu.tokens_changed if self.shared_cpu else None,
            )
        replica = SimReplica(f"{role}-{self._next_id}", role, engine, gpus, self.loop.now)
        if self.app.pool(role).engine.enable_prefix_caching:
            replica.cache = SimPrefixCache(self.shapes[role].num_blocks)
        if role == "prefill":
            replica.arrivals = RateMeter(clock=lambda: self.loop.now)
        else:
            replica.estimate = RemotePrefillEstimator(
                self.app.router.default_prefill_tokens_per_s, clock=lambda: self.loop.now
            )
            replica.arrivals = RateMeter(clock=lambda: self.loop.now)  # admitted prompt tokens
            replica.kv_refused = RateMeter(clock=lambda: self.loop.now)
        if shared:
            assert self.shared_cpu is not None
            self.shared_cpu.watch(replica.engine, helper.rescale_factor if helper else None)
        self.pools[role].append(replica)
        self.loop.after(ready_in, self._ready, replica)
        return replica

    def _ready(self, replica: SimReplica) -> None:
        replica.ready = True
        self._publish(replica)
        self._drain_backlog()

    def drain(self, replica: SimReplica) -> None:
        """Stop routing to ``replica``; it retires once its requests are done."""
        replica.draining = True
        self._pairs[replica.role] = None
        if replica.ongoing == 0 and replica.engine.idle:
            self.retire(replica)

    def routable(self, role: PoolRole) -> list[tuple[SimReplica, ReplicaStats | None]]:
        """(replica, its last report) for the pool's ready replicas that are not draining,
        in pool order: what Serve hands the pool's routers."""
        pairs = self._pairs[role]
        if pairs is None:
            pairs = [(r, r.stats) for r in self.pools[role] if r.ready and not r.draining]
            self._pairs[role] = pairs
            self._terms[role] = None
        return pairs

    def router_terms(self, role: PoolRole) -> list[tuple[SimReplica, Any]]:
        """``routable(role)`` with each report worked out for the pool's router
        (``routers.prefill_terms`` / ``decode_terms``): once per report, not per request."""
        pairs = self.routable(role)
        terms = self._terms[role]
        if terms is None:
            if role == "prefill":
                params = self.prefill_params
                terms = [(r, prefill_terms(stats, params)) for r, stats in pairs]
            else:
                terms = [(r, decode_terms(stats)) for r, stats in pairs]
            self._terms[role] = terms
        return terms

    # ------------------------------------------------------------------ run
    def run(self, requests: list[SimRequest], until: float | None = None) -> list[SimRequest]:
        """Simulate ``requests`` to completion; returns them, filled in."""
        self._open = len(requests)
        # Arrivals enter the event heap one at a time (each schedules the next), which keeps
        # the heap as small as the work in flight rather than the whole day's requests.
        self._arrivals = iter(sorted(requests, key=lambda r: r.arrival))
        self._next_arrival()
        self._start_publishing()
        if self.autoscaler.active:
            self.loop.after(0.0, self.autoscaler.tick)
        last = max((r.arrival for r in requests), default=0.0)
        self.loop.run(until=until if until is not None else last + self.s.max_queue_s)
        end = self.loop.now
        for req in requests:
            if req.finished_at is None and req.placement != "shed":
                self.counts["failed"] += 1
        for replica in self.pools["prefill"] + self.pools["decode"]:
            replica.stopped_at = end
        return requests

    def warm_up(self, requests: list[SimRequest]) -> float:
        """Send ``requests`` one at a time, each as the one before it finished (or was shed),
        as ``bench.serve --warmup`` does before its measured requests; returns when the last
        one finished, the measured requests' time 0. Their placements are not counted."""
        sent_at = self.loop.now
        for req in requests:
            req.arrival = sent_at
            self._open = 1
            self._arrivals = iter([req])
            self._next_arrival()
            self._start_publishing()
            self.loop.run_while(lambda: self._open > 0)
            sent_at = max(self.loop.now, req.finished_at or self.loop.now)
        self.counts = dict.fromkeys(self.counts, 0)
        self.reasons.clear()
        self.kv_refused = 0
        self.routes.clear()
        self.prefix_reasons.clear()
        self.kv_transfer_tokens = 0
        return sent_at

    def gpu_seconds(self) -> float:
        end = self.loop.now
        return sum(
            ((r.stopped_at if r.stopped_at is not None else end) - r.started_at) * r.gpus
            for r in self.retired + self.pools["prefill"] + self.pools["decode"]
        )

    def _done(self) -> None:
        self._open -= 1

    @property
    def open_requests(self) -> int:
        return self._open

    # ------------------------------------------------------------------ stats (live code)
    def _publish(self, replica: SimReplica) -> None:
        cost = self.costs[replica.role]
        replica.stats = replica_stats(
            replica.role,
            replica.engine.stats(),
            max_num_seqs=self.shapes[replica.role].max_num_seqs,
            kv_bytes_per_token=cost.kv_bytes_per_token,
            # Decode replicas report 0 here (their admitted rate goes to the autoscaler).
            prompt_tokens_per_s=(
                replica.arrivals.rate() if replica.arrivals and replica.role == "prefill" else 0.0
            ),
        )
        if replica.cache is not None and replica.cache.stored_any:
            self.prefix_index[replica.role].apply(
                replica.replica_id, replica.cache.publisher.publish()
            )
        self._pairs[replica.role] = None

    def _start_publishing(self) -> None:
        if not self._publishing:
            self._publishing = True
            self.loop.after(0.0, self._publish_all)

    def _publish_all(self) -> None:
        for replica in self.pools["prefill"] + self.pools["decode"]:
            if replica.ready:
                self._publish(replica)
        self._publishing = self._open > 0
        if self._publishing:
            self.loop.after(self.app.router.stats_period_s, self._publish_all)

    # ------------------------------------------------------------------ request path
    def _next_arrival(self) -> None:
        req = next(self._arrivals, None)
        if req is not None:
            # One event for the arrival and the ingress's work (nothing happens in between).
            self.loop.at(req.arrival + self.s.ingress_s, self._arrive, req)

    def _arrive(self, req: SimRequest) -> None:
        self._next_arrival()
        if self.shared_cpu is not None:
            # The request's own serving work (parse, tokenize, route, admit) stands between
            # it and the decode replica's engine: it reaches the engine once the shared CPUs
            # have worked off what was queued ahead of it and its own part.
            self.shared_cpu.arrived(req.prompt_tokens)
            wait = self.shared_cpu.delay()
            if wait > 0:
                self.loop.after(wait, self._route_decode, req)
                return
        self._route_decode(req)

    def _route_decode(self, req: SimRequest) -> bool:
        # Serve skips replicas at max_ongoing_requests; ranking only the others picks the
        # same replica (the ranking is a stable sort of per-replica scores).
        cap = self.app.decode.ongoing_limit
        candidates = [(r, t) for r, t in self.router_terms("decode") if r.ongoing < cap]
        if not candidates:
            self.backlog.append(req)  # Serve queues it until a replica has room
            return False
        shape = self.shapes["decode"]
        blocks = decode_blocks_needed(req.prompt_tokens, req.output_tokens, shape.block_size)
        # The live ranking over each replica's last report (worked out once per report).
        hashes = req.block_hashes if self.app.router.prefix_aware else ()
        if hashes:
            index = self.prefix_index["decode"]
            matched = {
                r.replica_id: index.matched_blocks(r.replica_id, hashes) for r, _ in candidates
            }
            ranked, reason = rank_decode_prefix(
                candidates,
                blocks,
                len(hashes),
                matched,
                self.ingress_books.by_replica,
                self.decode_params,
                self.affinity,
            )
            self.prefix_reasons["decode", reason] += 1
        else:
            ranked = rank_decode_terms(
                candidates,
                blocks,
                self.ingress_books.by_replica,
                self.decode_params,
            )
        for (replica,) in ranked:
            if replica.ongoing < cap:
                self.ingress_books.routed(str(req.rid), replica.replica_id, 1)
                if hashes:
                    self.prefix_index["decode"].routed(replica.replica_id, hashes)
                replica.ongoing += 1
                self.loop.after(self.s.rpc_s, self._on_decode, replica, req)
                return True
        self.backlog.append(req)  # Serve queues it until a replica has room
        return False

    def _drain_backlog(self) -> None:
        while self.backlog:
            req = self.backlog.popleft()
            if self.loop.now - req.arrival > self.s.max_queue_s:
                self._done()
                continue
            if not self._route_decode(req):
                self.backlog.pop()
                self.backlog.appendleft(req)
                return

    def _local_load(self, replica: SimReplica) -> LocalLoad:
        engine = replica.engine
        return LocalLoad(
            queued_prefill_tokens=engine.queued_prefill_tokens(),
            prefill_tokens_per_s=engine.prefill_meter.rate,
            num_running=engine.num_running,
            max_num_seqs=self.shapes["decode"].max_num_seqs,
        )

    def _on_decode(self, replica: SimReplica, req: SimRequest) -> None:
        load = self._local_load(replica)
        prefill_pool = self.routable("prefill")
        remote = replica.estimate if prefill_pool else None
        # The decode replica's own hit, as the decode server asks its engine (whole blocks;
        # the last prompt token is always computed).
        bs = self.shapes["decode"].block_size
        held = replica.cache.held_blocks(req.block_hashes) if replica.cache is not None else 0
        cached = min(held * bs, req.prompt_tokens - 1)
        decision = self.policy.decide(
            num_prompt_tokens=req.prompt_tokens,
            num_cached_tokens=cached,
            load=load,
            remote=remote,
        )
        self.reasons[decision.location, decision.reason] += 1
        if self.admission is not None and not self.admission.admit(
            AdmissionQuery(
                req,
                self.loop.now,
                replica.replica_id,
                decision,
                replica.engine.stats(),
                replica.ongoing,
                replica.itl.value,
                replica.outputs.value,
                remote,
                self.shapes["decode"].max_num_seqs,
                self.app.router.default_prefill_tokens_per_s,
            )
        ):
            self._shed(replica, req)
            return
        assert replica.arrivals is not None
        replica.arrivals.add(req.prompt_tokens)
        seq = Seq(req)
        if decision.location == "remote":
            if replica.engine.reserve_remote(seq):
                self._prefill_remotely(replica, seq, cached)
                return
            assert replica.kv_refused is not None
            replica.kv_refused.add(1)  # no room for the prompt's KV: prefilled here
            self.kv_refused += 1
        req.placement = "local"
        self.counts["local"] += 1
        self.routes[req.rid] = (replica.replica_id, None)
        seq.computed = req.cached_tokens = cached
        replica.engine.add(seq)
        if self.admission is not None:
            self.admission.taken_in(req)

    def _shed(self, replica: SimReplica, req: SimRequest) -> None:
        req.placement = "shed"
        self.counts["shed"] += 1
        self._release_decode(replica, req)
        self._done()

    def _prefill_remotely(self, replica: SimReplica, seq: Seq, decode_cached: int) -> None:
        """``decode_cached``: the prompt tokens the decode replica holds (whole blocks), the
        ``KVTarget.first_block`` it sends: only the rest crosses the link."""
        req, est = seq.req, replica.estimate
        assert est is not None
        n = req.prompt_tokens
        deadline_at = self.loop.now + est.compute_s(n) + self.app.transport.timeout_s
        ahead = est.started(n)
        books = replica.prefill_books.by_replica
        transfer_tokens = max(1, n - decode_cached)
        self._transfer[req.rid] = (transfer_tokens, decode_cached)
        hashes = req.block_hashes if self.app.router.prefix_aware else ()
        terms = self.router_terms("prefill")
        if hashes:
            index, bs = self.prefix_index["prefill"], self.shapes["prefill"].block_size
            held = {r.replica_id: index.matched_blocks(r.replica_id, hashes) * bs for r, _ in terms}
            ranked, reason = rank_prefill_prefix(terms, n, held, transfer_tokens, books)
            self.prefix_reasons["prefill", reason] += 1
            target = ranked[0][0]
            index.routed(target.replica_id, hashes)
        else:
            target = rank_prefill_terms(terms, n, books)[0][0]
        replica.prefill_books.routed(str(req.rid), target.replica_id, n)
        self.routes[req.rid] = (replica.replica_id, target.replica_id)
        req.placement = "remote"
        self.counts["remote"] += 1
        seq_p = Seq(req, prefill_only=True)
        deadline = self.loop.at(deadline_at, self._fall_back, req.rid)
        self._remote[req.rid] = RemoteInFlight(
            replica, target, seq, seq_p, self.loop.now, ahead, deadline
        )
        self.loop.after(self.s.rpc_s, self._on_prefill, target, seq_p)

    def _on_prefill(self, target: SimReplica, seq_p: Seq) -> None:
        if seq_p.req.rid not in self._remote:
            return  # the decode side gave up before the call arrived
        assert target.arrivals is not None
        req = seq_p.req
        if target.cache is not None:  # the prefill engine computes only what it lacks
            held = target.cache.held_blocks(req.block_hashes) * self.shapes["prefill"].block_size
            seq_p.computed = req.cached_tokens = min(held, req.prompt_tokens - 1)
        target.arrivals.add(req.prompt_tokens - seq_p.computed)  # as the prefill server counts
        target.engine.add(seq_p)

    def _prefill_done(self, replica: SimReplica, seq_p: Seq, t: float) -> None:
        """Last layer computed; the KV lands after the transfer's tail."""
        cost = self.costs["prefill"]
        req = seq_p.req
        if replica.cache is not None:
            replica.cache.insert(req.block_hashes)
        moved, _ = self._transfer.get(req.rid, (req.prompt_tokens, 0))
        transfer = cost.transfer_s(moved)
        compute = (req.prompt_tokens - req.cached_tokens) / max(
            replica.engine.prefill_meter.rate, 1e-9
        )
        tail = max(transfer / max(getattr(cost, "num_layers", 1), 1), transfer - compute)
        self.loop.after(tail, self._release_prefill, replica, seq_p)
        self.loop.after(tail + self.s.rpc_s, self._landed, seq_p.req.rid)

    def _release_prefill(self, replica: SimReplica, seq_p: Seq) -> None:
        replica.engine.release(seq_p)
        if replica.draining and replica.engine.idle:
            self.retire(replica)

    def _landed(self, rid: int) -> None:
        remote = self._remote.pop(rid, None)
        if remote is None:
            return  # already fell back
        remote.deadline.cancel()
        n = remote.seq_d.req.prompt_tokens
        est = remote.decode.estimate
        assert est is not None
        est.observe(
            n,
            self.loop.now - remote.began,
            remote.prefill.engine.prefill_meter.rate,
            remote.ahead,
            remote.prefill.replica_id,
        )
        est.finished(n)
        remote.decode.prefill_books.completed(str(rid))
        moved, _ = self._transfer.pop(rid, (n, 0))
        self.kv_transfer_tokens += moved
        remote.decode.engine.complete_remote(remote.seq_d)

    def _fall_back(self, rid: int) -> None:
        remote = self._remote.pop(rid)
        remote.prefill.engine.abort(remote.seq_p)
        n = remote.seq_d.req.prompt_tokens
        est = remote.decode.estimate
        assert est is not None
        est.observe(n, self.loop.now - remote.began, 0.0, remote.ahead)
        est.finished(n)
        remote.decode.prefill_books.completed(str(rid))
        remote.seq_d.req.placement = "fallback"
        self.counts["fallback"] += 1
        # Only the tokens past the prefix the decode replica kept are recomputed.
        _, kept = self._transfer.pop(rid, (0, 0))
        remote.seq_d.req.cached_tokens = kept
        remote.decode.engine.fail_remote(remote.seq_d, kept)

    def _streamed(self) -> float:
        """How long a token emitted now takes to reach the client: one hop, and on a small
        local cluster the serving work queued ahead of it on the shared CPUs."""
        if self.shared_cpu is None:
            return self.s.rpc_s
        return self.s.rpc_s + self.shared_cpu.delay()

    def _first_token(self, replica: SimReplica, seq: Seq, t: float) -> None:
        seq.req.first_token_at = t + self._streamed()
        if replica.cache is not None:  # its prompt's KV is in this engine now
            replica.cache.insert(seq.req.block_hashes)
        if self.admission is not None:
            self.admission.first_token(seq.req, t)

    def _finished(self, replica: SimReplica, seq: Seq, t: float) -> None:
        req = seq.req
        req.finished_at = t + self._streamed()
        tpot = req.tpot
        if tpot is not None:
            replica.itl.add(tpot)
        replica.outputs.add(req.output_tokens)
        if self.admission is not None:
            self.admission.finished(req)
        self._release_decode(replica, req)
        self._done()

    def _release_decode(self, replica: SimReplica, req: SimRequest) -> None:
        replica.ongoing -= 1
        self.ingress_books.completed(str(req.rid))
        if replica.draining and replica.ongoing == 0 and replica.engine.idle:
            self.retire(replica)
        if self.backlog:
            self._drain_backlog()

    def retire(self, replica: SimReplica) -> None:
        if replica not in self.pools[replica.role]:
            return
        self.pools[replica.role].remove(replica)
        self.prefix_index[replica.role].forget(replica.replica_id)
        self._pairs[replica.role] = None
        replica.stopped_at = self.loop.now
        self.retired.append(replica)
