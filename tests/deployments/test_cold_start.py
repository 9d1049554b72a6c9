"""Right after deploy, a closed-loop client at the concurrency the replica serves inside
the SLO is never refused: neither by the decode replica's own admission
(``DecodeAdmission``, the engine's ``ThroughputMeter``) nor by the ingress's door in front
of it (``FrontDoor``, its ``StreamLimit``), against a replica modelled on the colocated
config's step times (``admission_fakes``, docs/tuning.md): a fresh engine's first prefill
step pays one-time costs, chunked prefill of 512 tokens per step, 460-token prompts."""

from __future__ import annotations

from pdserve.deployments.admission.decode import AdmissionRequest, ReplicaSignals
from pdserve.deployments.admission.signals import stream_lag_budget_s
from pdserve.engine.stats import ThroughputMeter
from tests.deployments.admission_fakes import (
    BUDGET,
    COLD_STEP_S,
    OUTPUT,
    PROMPT,
    DoorAndReplica,
    ModelReplica,
    run_closed_loop,
)

# The loop lag of an ingress on a loaded shared CPU: past the stream bound's lag budget
# (a sixth of reject_within_ms), short of the lag at which the ingress sheds everything.
LOADED_LOOP_LAG_S = 3 * stream_lag_budget_s(0.1)


def test_a_closed_loop_of_eight_right_after_deploy_is_never_shed() -> None:
    replica = ModelReplica()
    run_closed_loop(replica, concurrency=1, num_requests=4)  # the warm-ups, one at a time
    run_closed_loop(replica, concurrency=8, num_requests=32)
    threshold = replica.admission.rules.threshold_s("interactive")
    # Queueing serves the load inside the shed threshold, so nothing may be shed.
    assert max(replica.ttfts[4:]) < threshold
    assert replica.sheds == 0


def test_the_door_refuses_none_of_a_closed_loop_the_replica_serves_right_after_deploy() -> None:
    """The same start through the ingress's door, its loop lagging past the stream bound's
    budget throughout (a shared CPU): the cold first step makes the first warm-up's first
    token late, yet no stream of the door's was ahead of it, and the loop's lag guards 429s
    the door is not answering. Every one of the 32 is served, none refused."""
    server = DoorAndReplica(ModelReplica(), loop_lag_s=LOADED_LOOP_LAG_S)
    assert run_closed_loop(server, concurrency=1, num_requests=4, prefix="w") == 0
    assert server.replica.ttfts[0] >= COLD_STEP_S  # late: past the 2 s target
    assert run_closed_loop(server, concurrency=8, num_requests=32) == 0
    assert server.record.sheds == [] and server.replica.sheds == 0
    assert max(server.replica.ttfts[4:]) < server.replica.admission.rules.threshold_s("interactive")
    assert server.door.streams is not None and server.door.streams.sustained >= 8
    assert server.door.num_open == 0


def test_a_lone_decode_shed_does_not_cut_the_door_below_the_sustained_loop() -> None:
    """Mid-loop, another decode replica sheds one request (its queue just over its
    threshold) while the door sustains a closed loop of 8 in time: that client gets its
    429, and no other does: the door's bound stays at what was served (0.7 x 8 would
    refuse two of the loop's clients at every retry), and one replica's hint leaves the
    door open while the other has room."""
    server = DoorAndReplica(ModelReplica(), loop_lag_s=LOADED_LOOP_LAG_S)
    run_closed_loop(server, concurrency=1, num_requests=4, prefix="w")
    assert run_closed_loop(server, concurrency=8, num_requests=16, prefix="a") == 0
    server.door.heard_from("decode-1")
    server.shed_elsewhere.add("b5")
    assert run_closed_loop(server, concurrency=8, num_requests=32, prefix="b") == 1
    assert server.record.sheds == [] and server.replica.sheds == 0
    assert server.door.streams is not None and server.door.streams.limit >= 8


def test_the_queue_ahead_counts_the_chunks_the_engine_already_computed() -> None:
    replica = ModelReplica()
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


def test_the_sustained_loop_stops_flooring_the_door_after_a_quiet_spell() -> None:
    """The closed loop of 8 served in time, then a quiet minute on the model's clock: the
    floor it set has expired, so the next decode shed cuts the door's bound below 8, where
    within the window (the test above) it did not."""
    server = DoorAndReplica(ModelReplica(), loop_lag_s=LOADED_LOOP_LAG_S)
    run_closed_loop(server, concurrency=1, num_requests=4, prefix="w")
    assert run_closed_loop(server, concurrency=8, num_requests=16, prefix="a") == 0
    streams = server.door.streams
    assert streams is not None and streams.sustained >= 8 and streams.limit >= 8
    server.replica.now += 60.0  # three windows of ten 2 s targets
    server.door.heard_from("decode-1")
    server.shed_elsewhere.add("b1")
    assert run_closed_loop(server, concurrency=1, num_requests=1, prefix="b") == 1
    assert streams.sustained == 0 and streams.limit < 8
