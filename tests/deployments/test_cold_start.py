"""Right after deploy, a closed-loop client at the concurrency the replica serves inside
the SLO is never shed: the decode replica's own admission (``DecodeAdmission``, the
engine's ``ThroughputMeter``) against a replica modelled on the colocated config's step
times (docs/tuning.md): a fresh engine's first prefill step pays one-time costs, chunked
prefill of 512 tokens per step, 460-token prompts."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.deployments.admission.decode import (
    AdmissionRequest,
    DecodeAdmission,
    ReplicaSignals,
)
from pdserve.deployments.config import AppConfig
from pdserve.deployments.load import Ema
from pdserve.engine.stats import EngineStats, ThroughputMeter

CONFIG = {
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


class _Replica:
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
        self.now += seconds
        if prefill:
            self.prefill_meter.update(prefill, seconds)
        else:
            self.decode_meter.update(len(decoding), seconds)
        for s, n in chunks:
            s.uncomputed -= n
            if s.uncomputed == 0:  # the prefill's last chunk samples the first token
                s.output_left -= 1
                self.admission.first_token(s.rid, self.now)
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


def run_closed_loop(replica: _Replica, concurrency: int, num_requests: int) -> None:
    """Each client sends its next request as its last one ends (at once after a 429)."""
    sent = 0
    clients = concurrency
    while sent < num_requests or replica.seqs:
        while clients and sent < num_requests:
            sent += 1
            if replica.send(f"r{sent}"):
                clients -= 1
        clients += len(replica.step())


def test_a_closed_loop_of_eight_right_after_deploy_is_never_shed() -> None:
    replica = _Replica()
    run_closed_loop(replica, concurrency=1, num_requests=4)  # the warm-ups, one at a time
    run_closed_loop(replica, concurrency=8, num_requests=32)
    threshold = replica.admission.rules.threshold_s("interactive")
    # Queueing serves the load inside the shed threshold, so nothing may be shed.
    assert max(replica.ttfts[4:]) < threshold
    assert replica.sheds == 0


def test_the_queue_ahead_counts_the_chunks_the_engine_already_computed() -> None:
    replica = _Replica()
    run_closed_loop(replica, concurrency=1, num_requests=2)
    for i in range(3):
        assert replica.send(f"q{i}")
    replica.step()  # 512 of the 3 x 460 prompt tokens computed
    uncached = PROMPT
    req = AdmissionRequest("next", "interactive", uncached, 0, OUTPUT, replica.now, "local")
    signals = ReplicaSignals(replica.stats(), None, replica.itl.value, replica.outputs.value)
    ahead = replica.admission.queue_ahead(req, signals, replica.now)
    assert ahead.queued_prefill_tokens == 3 * PROMPT - BUDGET


def test_a_cold_first_step_does_not_linger_in_the_measured_rate() -> None:
    meter = ThroughputMeter(alpha=0.2)
    meter.update(460, COLD_STEP_S)
    assert meter.rate == 460 / COLD_STEP_S  # one step is a measurement
    meter.update(460, 0.3)
    assert meter.rate == 460 / 0.3  # the second replaces the cold one
    meter.update(460, 0.6)
    assert meter.rate == 0.2 * (460 / 0.6) + 0.8 * (460 / 0.3)  # then an average
