"""Fakes for overload-control tests: a colocated decode replica modelled on the colocated
config's step times (docs/tuning.md), running the live ``DecodeAdmission``; an ingress
``FrontDoor`` on that replica's clock with a loop lag the test sets; and a closed-loop
client driving both. Deterministic: time is the model's, never the wall clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.deployments.admission.decode import (
    AdmissionRequest,
    DecodeAdmission,
    ReplicaSignals,
)
from pdserve.deployments.admission.front_door import (
    DoorShed,
    FrontDoor,
    FrontDoorSettings,
    Ticket,
)
from pdserve.deployments.config import AppConfig
from pdserve.deployments.load import Ema
from pdserve.engine.stats import EngineStats, ThroughputMeter

CONFIG: dict[str, Any] = {
    "model": {"test_model": "small", "device": "cpu"},
    "decode": {"engine": {"max_num_batched_tokens": 512, "max_num_seqs": 64}},
    "policy": {"mode": "always_local"},
    "slo": {"ttft_ms": 2000, "tpot_ms": 200},
}
BUDGET = 512  # tokens per engine step
COLD_STEP_S = 5.0  # a fresh engine's first prefill step (measured: 1.2-5 s)
PREFILL_S_PER_TOKEN = 0.3 / 512  # a warm step of 512 prompt tokens: 0.3 s
DECODE_STEP_S = 0.05
PROMPT, OUTPUT = 460, 32


@dataclass
class _Seq:
    rid: str
    uncomputed: int
    output_left: int
    arrival: float


@dataclass(frozen=True)
class PlannedStep:
    chunks: list[tuple[_Seq, int]]  # prompt chunks: (sequence, tokens)
    decoding: list[_Seq]
    seconds: float  # on a CPU of its own


class ModelReplica:
    """A colocated decode replica: FCFS chunked prefill, one token per running sequence
    per step, the meters and snapshot its engine keeps, the admission its server runs."""

    def __init__(self) -> None:
        self.admission = DecodeAdmission.from_config(AppConfig.from_dict(CONFIG))
        self.prefill_meter, self.decode_meter = ThroughputMeter(), ThroughputMeter()
        self.itl, self.outputs = Ema(), Ema()
        self.seqs: list[_Seq] = []
        self.now = 0.0
        self.cold = True
        self.sheds = 0
        self.ttfts: list[float] = []
        # (request, predicted TTFT) of each first token of the last step, for the ingress.
        self.first_tokens: list[tuple[str, float | None]] = []

    def stats(self) -> EngineStats:
        prefilling = [s for s in self.seqs if s.uncomputed > 0]
        return EngineStats(
            num_running=len(self.seqs) - len(prefilling),
            num_waiting=len(prefilling),
            num_waiting_remote_kv=0,
            num_sending_kv=0,
            num_free_blocks=1000,
            num_total_blocks=1000,
            block_size=16,
            queued_prefill_tokens=sum(s.uncomputed for s in prefilling),
            prefill_tokens_per_s=self.prefill_meter.rate,
            decode_tokens_per_s=self.decode_meter.rate,
            kv_usage=0.0,
            num_preemptions=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_prompt_tokens=0,
            num_generation_tokens=0,
        )

    def send(self, rid: str) -> bool:
        """A request arrives now: admitted (the engine takes it in) or shed."""
        req = AdmissionRequest(rid, "interactive", PROMPT, 0, OUTPUT, self.now, "local")
        signals = ReplicaSignals(self.stats(), None, self.itl.value, self.outputs.value)
        verdict = self.admission.admit(req, signals, self.now)
        if verdict.action != "admit":
            self.sheds += 1
            return False
        self.seqs.append(_Seq(rid, PROMPT, OUTPUT, self.now))
        self.admission.taken_in(rid)
        return True

    def step(self) -> list[str]:
        """One engine step; returns the requests it finished."""
        planned = self.plan()
        self.now += planned.seconds
        return self.complete(planned, planned.seconds)

    def plan(self) -> PlannedStep:
        """The next step's chunks and its time on an idle CPU (the engine's schedule)."""
        decoding = [s for s in self.seqs if s.uncomputed == 0]
        budget, chunks = BUDGET - len(decoding), []
        for s in self.seqs:
            if s.uncomputed > 0 and budget > 0:
                n = min(budget, s.uncomputed)
                chunks.append((s, n))
                budget -= n
        prefill = sum(n for _, n in chunks)
        seconds = DECODE_STEP_S + prefill * PREFILL_S_PER_TOKEN
        if prefill and self.cold:
            seconds, self.cold = COLD_STEP_S, False
        return PlannedStep(chunks, decoding, seconds)

    def complete(self, planned: PlannedStep, seconds: float) -> list[str]:
        """A planned step ends at ``self.now`` after ``seconds`` of wall time: the meters,
        first tokens and finished requests; returns the requests it finished."""
        chunks, decoding = planned.chunks, planned.decoding
        prefill = sum(n for _, n in chunks)
        if prefill:
            self.prefill_meter.update(prefill, seconds)
        else:
            self.decode_meter.update(len(decoding), seconds)
        self.first_tokens = []
        for s, n in chunks:
            s.uncomputed -= n
            if s.uncomputed == 0:  # the prefill's last chunk samples the first token
                s.output_left -= 1
                score = self.admission.first_token(s.rid, self.now)
                self.first_tokens.append((s.rid, score.predicted_s if score else None))
                self.ttfts.append(self.now - s.arrival)
        if decoding:
            self.itl.add(seconds)
        for s in decoding:
            s.output_left -= 1
        done = [s for s in self.seqs if s.output_left == 0]
        for s in done:
            self.seqs.remove(s)
            self.outputs.add(OUTPUT)
            self.admission.finished(s.rid)
        return [s.rid for s in done]

    @property
    def busy(self) -> bool:
        return bool(self.seqs)

    def advance(self) -> int:
        """One step; returns how many requests it finished."""
        return len(self.step())


class Server(Protocol):
    """What a closed-loop client sees: requests answered or refused, streams ending."""

    @property
    def busy(self) -> bool: ...

    def send(self, rid: str) -> bool: ...

    def advance(self) -> int: ...


def run_closed_loop(server: Server, concurrency: int, num_requests: int, prefix: str = "r") -> int:
    """Each client sends its next request as its last one ends (at once after a 429, as
    ``vllm bench serve --max-concurrency`` does); returns the number of 429s."""
    sent = refused = 0
    clients = concurrency
    while sent < num_requests or server.busy:
        while clients and sent < num_requests:
            sent += 1
            if server.send(f"{prefix}{sent}"):
                clients -= 1
            else:
                refused += 1
        clients += server.advance()
    return refused


class FakeLoopLag:
    """The ingress's loop lag, as the test sets it (``FrontDoor``'s ``LoopLagSignal``)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds

    def ensure_running(self) -> None:
        pass


@dataclass
class DoorRecord:
    """What a door shed (reason per 429) and the turned-away counts it reported."""

    sheds: list[str] = field(default_factory=list)
    reported: list[int] = field(default_factory=list)

    def record_shed(self, reason: str, slo_class: str, n: int = 1) -> None:
        self.sheds.extend([reason] * n)

    def record_streams(self, num_open: int, limit: float | None) -> None:
        pass


def one_stream_door(record: DoorRecord) -> FrontDoor:
    """A door whose stream bound starts at one (of at most four), with a 2 s TTFT SLO, no
    loop lag, and ``record`` as its metrics and turned-away reports."""
    from pdserve.deployments.admission.stream_limit import StreamLimit

    return FrontDoor(
        FrontDoorSettings(ttft_slo_s=2.0, max_streams=4),
        record,
        record.reported.append,
        streams=StreamLimit(target_s=2.0, high=4, initial=1),
        loop_lag=FakeLoopLag(),
    )


class DoorAndReplica:
    """An ingress's ``FrontDoor`` (the app config's settings, the replica's clock, a set
    loop lag) in front of a ``ModelReplica``, driven the way the ingress drives them."""

    def __init__(self, replica: ModelReplica, loop_lag_s: float = 0.0) -> None:
        self.replica = replica
        self.loop_lag = FakeLoopLag(loop_lag_s)
        self.record = DoorRecord()
        self.door = FrontDoor(
            FrontDoorSettings.from_config(AppConfig.from_dict(CONFIG)),
            self.record,
            self.record.reported.append,
            loop_lag=self.loop_lag,
            clock=lambda: replica.now,
        )
        self.tickets: dict[str, Ticket] = {}
        # Requests that Serve routes to another decode replica, which sheds them.
        self.shed_elsewhere: set[str] = set()

    def send(self, rid: str) -> bool:
        """One request through the door, then the replica: admitted, or a 429 (the door's
        or a replica's)."""
        door_pass = self.door.admit("interactive")
        if isinstance(door_pass, DoorShed):
            return False
        ticket = self.door.opened("interactive", door_pass)
        if rid in self.shed_elsewhere:
            self.door.refused(ticket, retry_after_s=0.5, replica="decode-1")
            self.door.closed(ticket, had_first_token=False)
            return False
        if not self.replica.send(rid):
            self.door.refused(ticket, retry_after_s=0.5, replica="decode-0")
            self.door.closed(ticket, had_first_token=False)
            return False
        self.door.heard_from("decode-0")
        self.tickets[rid] = ticket
        return True

    @property
    def busy(self) -> bool:
        return bool(self.tickets)

    def advance(self) -> int:
        """One engine step: its first tokens and finished streams reach the door; returns
        how many streams finished."""
        done = self.replica.step()
        for rid, predicted_s in self.replica.first_tokens:
            self.door.first_token(self.tickets[rid], predicted_s)
        for rid in done:
            self.door.closed(self.tickets.pop(rid), had_first_token=True)
        return len(done)
