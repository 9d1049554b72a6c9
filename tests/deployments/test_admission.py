"""Admission control as pure functions: the TTFT prediction from the queue ahead, the
admit/shed decision per priority class, Retry-After from the drain time."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.deployments.admission import rules as admission_rules
from pdserve.deployments.admission import signals, stream_limit
from pdserve.deployments.admission.rules import AdmissionRules, QueueAhead

RULES = AdmissionRules(
    ttft_slo_s=2.0,
    interactive_factor=1.5,
    batch_factor=1.0,
    interactive_on_miss="shed",
    batch_on_miss="shed",
    interactive_max_wait_s=8.0,
    batch_max_wait_s=120.0,
)


def ahead(**overrides: float) -> QueueAhead:
    base = QueueAhead(
        waited_s=0.0,
        num_in_batch=0,
        max_num_seqs=8,
        step_s=0.05,
        mean_output_tokens=16,
        queued_prefill_tokens=0,
        prefill_tokens_per_s=500.0,
    )
    return dataclasses.replace(base, **overrides)


def test_an_idle_replica_predicts_the_prompt_alone() -> None:
    p = admission_rules.predict_ttft(ahead(), uncached_tokens=100)
    assert p.slot_wait_s == 0.0
    assert p.total_s == pytest.approx(100 / 500 + 0.05)
    assert admission_rules.decide(p, "interactive", RULES).action == "admit"


def test_queued_prefill_tokens_ahead_count_at_the_measured_rate() -> None:
    p = admission_rules.predict_ttft(ahead(queued_prefill_tokens=1400, waited_s=0.5), 100)
    assert p.prefill_s == pytest.approx(1500 / 500)
    assert p.total_s == pytest.approx(0.5 + 3.0 + 0.05)  # 3.55 s > 1.5 x 2 s
    d = admission_rules.decide(p, "interactive", RULES)
    assert (d.action, d.reason) == ("shed", "ttft_slo")


def test_a_full_batch_waits_for_running_requests_to_finish() -> None:
    # 8 running + 4 waiting, 8 slots: the new one is 5th in line; 8 requests of 16 tokens
    # at 0.05 s/step finish at 8 / 0.8 s = 10 per second -> 0.5 s.
    q = ahead(num_in_batch=12)
    assert admission_rules.slot_wait_s(q) == pytest.approx(5 * 16 * 0.05 / 8)
    assert admission_rules.slot_wait_s(ahead(num_in_batch=7)) == 0.0


def test_remote_prefill_overhead_is_part_of_the_prediction() -> None:
    p = admission_rules.predict_ttft(ahead(prefill_overhead_s=0.3), 100)
    assert p.prefill_s == pytest.approx(0.3 + 0.2)


def test_retry_after_is_the_predicted_drain_time_not_a_constant() -> None:
    small = admission_rules.predict_ttft(ahead(queued_prefill_tokens=2000), 100)  # 4.25 s
    large = admission_rules.predict_ttft(ahead(queued_prefill_tokens=10000), 100)  # 20.25 s
    d_small = admission_rules.decide(small, "interactive", RULES)
    d_large = admission_rules.decide(large, "interactive", RULES)
    # Exact (the ingress sheds the class at its door for that long); HTTP's header rounds up.
    assert d_small.retry_after_s == pytest.approx(1.25)  # 4.25 - 3.0
    assert d_large.retry_after_s == pytest.approx(17.25)  # 20.25 - 3.0
    # Never under MIN_DRAIN_S, even when just over the threshold.
    edge = admission_rules.predict_ttft(ahead(queued_prefill_tokens=1480), 1)  # 3.012 s
    edge_retry = admission_rules.decide(edge, "interactive", RULES).retry_after_s
    assert edge_retry == admission_rules.MIN_DRAIN_S


def test_batch_sheds_first() -> None:
    # 2.5 s: over the batch threshold (1.0 x SLO), under the interactive one (1.5 x SLO).
    p = admission_rules.predict_ttft(ahead(queued_prefill_tokens=1125), 100)
    assert admission_rules.decide(p, "interactive", RULES).action == "admit"
    assert admission_rules.decide(p, "batch", RULES).action == "shed"


def test_queueing_stays_available_per_class() -> None:
    rules = dataclasses.replace(RULES, interactive_on_miss="queue", batch_on_miss="queue")
    p = admission_rules.predict_ttft(ahead(queued_prefill_tokens=5000), 100)
    d = admission_rules.decide(p, "interactive", rules)
    assert (d.action, d.reason, d.retry_after_s) == ("admit", "queued_past_slo", None)


def test_a_request_that_waited_past_its_deadline_is_dropped_but_batch_may_wait_longer() -> None:
    rules = dataclasses.replace(RULES, interactive_on_miss="queue", batch_on_miss="queue")
    p = admission_rules.predict_ttft(ahead(waited_s=9.0), 10)
    d = admission_rules.decide(p, "interactive", rules)
    assert (d.action, d.reason) == ("shed", "deadline")
    assert admission_rules.decide(p, "batch", rules).action == "admit"


def test_calibration_scales_the_remaining_part_only() -> None:
    cal = admission_rules.Calibration(alpha=1.0)
    cal.observe(predicted_remaining_s=1.0, actual_remaining_s=2.0)
    assert cal.value == 2.0
    p = admission_rules.predict_ttft(ahead(waited_s=1.0), 100, calibration=cal.value)
    assert p.total_s == pytest.approx(1.0 + 2 * (0.2 + 0.05))
    cal.observe(1.0, 100.0)  # clipped
    assert cal.value == 4.0


def test_pending_prefills_count_admitted_work_until_first_token() -> None:
    book = admission_rules.PendingPrefills()
    book.admitted("a", "local", 100)
    book.admitted("b", "remote", 50)
    assert (book.tokens("local"), book.tokens("remote"), book.num_open) == (100, 50, 2)
    book.first_token("a")
    assert (book.tokens("local"), book.num_open) == (0, 2)
    book.finished("a")
    book.finished("b")
    assert (book.tokens("remote"), book.num_open) == (0, 0)


def test_bad_inputs_name_the_value() -> None:
    with pytest.raises(ValueError, match="uncached_tokens"):
        admission_rules.predict_ttft(ahead(), 0)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        admission_rules.predict_ttft(ahead(prefill_tokens_per_s=0.0), 10)
    with pytest.raises(ValueError, match="ttft_slo_s"):
        dataclasses.replace(RULES, ttft_slo_s=0.0)


def test_a_full_replica_sheds_at_once_but_queueing_classes_still_queue() -> None:
    rules = dataclasses.replace(RULES, max_admitted=16, batch_on_miss="queue")
    p = admission_rules.predict_ttft(ahead(), 10)  # well within the SLO
    d = admission_rules.decide(p, "interactive", rules, num_admitted=16)
    assert (d.action, d.reason) == ("shed", "queue_full")
    assert d.retry_after_s == admission_rules.MIN_DRAIN_S
    assert admission_rules.decide(p, "interactive", rules, num_admitted=15).action == "admit"
    assert admission_rules.decide(p, "batch", rules, num_admitted=16).action == "admit"


def test_the_ingress_sheds_within_the_drain_time_a_replica_reported() -> None:
    hint = signals.ShedHint()
    assert hint.remaining_s("interactive", 0.0) == 0.0
    hint.shed("batch", now=10.0, drain_s=3.0)
    assert hint.remaining_s("batch", 11.0) == 2.0
    assert hint.remaining_s("interactive", 11.0) == 0.0  # batch sheds first, alone
    hint.shed("interactive", now=11.0, drain_s=1.0)
    assert hint.remaining_s("interactive", 11.5) == 0.5
    assert hint.remaining_s("batch", 11.5) == 1.5  # the longer window is kept
    assert hint.remaining_s("interactive", 12.0) == 0.0


def test_the_door_closes_only_while_every_known_decode_replica_sheds() -> None:
    hint = signals.ShedHint(seen_window_s=30.0)
    hint.seen("b", now=0.0)
    hint.shed("interactive", now=1.0, drain_s=3.0, replica="a")
    assert hint.remaining_s("interactive", 1.5) == 0.0  # b has room
    hint.shed("batch", now=2.0, drain_s=1.0, replica="b")
    assert hint.remaining_s("batch", 2.5) == 0.5  # both shed batch: the first to drain
    assert hint.remaining_s("interactive", 2.5) == 0.0  # b still takes interactive
    hint.shed("interactive", now=2.5, drain_s=5.0, replica="b")
    assert hint.remaining_s("interactive", 3.0) == 1.0  # a drains first
    # b not heard from for longer than the window: a alone is the pool.
    hint.shed("interactive", now=40.0, drain_s=2.0, replica="a")
    assert hint.remaining_s("interactive", 41.0) == 1.0
    hint.shed("batch", now=50.0, drain_s=2.0)  # a shed naming no replica: the whole pool
    hint.seen("c", now=50.0)
    assert hint.remaining_s("batch", 51.0) == 1.0
    with pytest.raises(ValueError, match="seen_window_s"):
        signals.ShedHint(seen_window_s=0.0)


def test_a_shed_is_told_the_pools_drain_time_uncapped_by_the_doors_window() -> None:
    """The Retry-After of a shed: until the first known replica drains by its own
    prediction (not capped like the door's window), 0 while one has no shed."""
    hint = signals.ShedHint(max_window_s=1.0)
    hint.shed("interactive", now=0.0, drain_s=4.0, replica="a")
    assert hint.retry_after_s("interactive", 1.0) == 3.0  # a alone: its own 4 s
    assert hint.remaining_s("interactive", 1.0) == 0.0  # the door asks again after 1 s
    hint.seen("b", now=1.0)
    assert hint.retry_after_s("interactive", 1.5) == 0.0  # b has room
    hint.shed("interactive", now=2.0, drain_s=0.5, replica="b")
    assert hint.retry_after_s("interactive", 2.0) == 0.5  # b drains first
    assert hint.retry_after_s("batch", 2.0) == 0.5  # an interactive shed is a batch one


def test_the_ingress_asks_a_replica_again_after_at_most_max_window() -> None:
    hint = signals.ShedHint(max_window_s=1.0)
    hint.shed("interactive", now=20.0, drain_s=13.0)  # a pessimistic prediction
    assert hint.remaining_s("interactive", 20.5) == 0.5
    assert hint.remaining_s("batch", 21.0) == 0.0  # the next request reaches a replica
    hint.shed("batch", now=21.0, drain_s=0.25)  # shorter windows are kept as they are
    assert hint.remaining_s("batch", 21.0) == 0.25
    with pytest.raises(ValueError, match="max_window_s"):
        signals.ShedHint(max_window_s=0.0)


def test_a_lagging_ingress_loop_sheds_batch_first() -> None:
    assert not signals.ingress_overloaded(0.05, "batch", 2.0)
    assert signals.ingress_overloaded(0.15, "batch", 2.0)
    assert not signals.ingress_overloaded(0.15, "interactive", 2.0)
    assert signals.ingress_overloaded(0.3, "interactive", 2.0)


def test_a_lagging_proxy_counts_until_its_measure_expires() -> None:
    """The proxy's lag (waits for request bodies) sheds like the ingress's own, but only
    while recent: shedding reads no body, so an old measure expires and requests pass to
    measure again, starting from 0 (one slow read alone sheds little)."""
    lag = signals.ProxyLag(alpha=0.5, hold_s=1.0)
    assert lag.seconds(0.0) == 0.0
    lag.observe(0.8, now=10.0)
    assert lag.seconds(10.5) == pytest.approx(0.4)
    lag.observe(0.8, now=10.6)
    assert lag.seconds(10.6) == pytest.approx(0.6)
    overloaded = signals.ingress_overloaded
    assert overloaded(0.01, "interactive", 2.0, proxy_lag_s=lag.seconds(10.6))
    assert lag.seconds(11.7) == 0.0  # expired: the door opens to measure again
    lag.observe(0.02, now=11.8)  # the proxy caught up
    assert lag.seconds(11.8) == pytest.approx(0.01)
    assert not overloaded(0.01, "interactive", 2.0, proxy_lag_s=lag.seconds(11.8))
    # The proxy may take a quarter of the SLO with the loop (batch: an eighth), the loop
    # alone a tenth.
    assert not overloaded(0.05, "interactive", 2.0, proxy_lag_s=0.4)
    assert overloaded(0.05, "batch", 2.0, proxy_lag_s=0.4)
    assert overloaded(0.21, "interactive", 2.0, proxy_lag_s=0.0)
    with pytest.raises(ValueError, match="hold_s"):
        signals.ProxyLag(hold_s=0.0)


def test_a_prediction_from_the_configured_prior_rate_never_sheds() -> None:
    """A cold pool has no measured prefill rate yet: over the threshold it queues (reason
    'unmeasured'), since shedding on the prior would turn a whole cold burst away."""
    q = ahead(queued_prefill_tokens=1400, rate_measured=False)
    p = admission_rules.predict_ttft(q, 100)
    assert p.total_s > RULES.threshold_s("interactive")
    d = admission_rules.decide(p, "interactive", RULES)
    assert (d.action, d.reason, d.retry_after_s) == ("admit", "unmeasured", None)
    # The same queue with a measured rate sheds.
    measured = admission_rules.predict_ttft(dataclasses.replace(q, rate_measured=True), 100)
    assert admission_rules.decide(measured, "interactive", RULES).action == "shed"


def test_the_stream_limit_grows_only_while_in_use_and_first_tokens_are_fast() -> None:
    """Slow start: +1 per fast first token of a request admitted near the bound; a request
    admitted with the bound far from use (a quiet spell) teaches nothing."""
    limit = stream_limit.StreamLimit(target_s=2.0, high=64, initial=8)
    assert limit.admits("interactive", 7) and not limit.admits("interactive", 8)
    limit.observe(0.5, admitted_at=0.0, open_at_admission=2, now=0.5)  # quiet: no growth
    assert limit.limit == 8
    limit.observe(0.5, admitted_at=1.0, open_at_admission=7, now=1.5)
    assert limit.limit == 9
    limit.observe(1.5, admitted_at=2.0, open_at_admission=8, now=3.5)  # a queue starts
    assert limit.limit == 9 and not limit.slow_start
    limit.observe(0.5, admitted_at=4.0, open_at_admission=8, now=4.5)
    assert limit.limit == pytest.approx(9 + 1 / 9)  # one per window now


def test_a_late_first_token_cuts_the_limit_once_per_round_trip() -> None:
    """Past the target: cut to 0.7 x the streams that were open, at most by half (the bound
    of 40 with 20 in use), and the requests admitted before that cut cannot cut again (they
    show the old queue)."""
    limit = stream_limit.StreamLimit(target_s=2.0, high=64, initial=40)
    limit.observe(3.0, admitted_at=10.0, open_at_admission=19, now=13.0)
    assert limit.limit == pytest.approx(20)  # half; 0.7 x 20 in use would be 14
    assert not limit.admits("interactive", 20)
    limit.observe(3.5, admitted_at=10.5, open_at_admission=25, now=13.5)  # same episode
    assert limit.limit == pytest.approx(20)
    limit.observe(2.5, admitted_at=13.2, open_at_admission=19, now=15.7)  # admitted after
    assert limit.limit == pytest.approx(0.7 * 20)
    for i in range(20):
        limit.observe(9.0, admitted_at=100.0 + i, open_at_admission=1, now=101.0 + i)
    assert limit.limit == 1 and limit.admits("interactive", 0)  # never below low


def test_a_late_first_token_with_no_other_stream_open_does_not_cut_the_limit() -> None:
    """A fresh engine's first step (5 s) answering a lone warm-up request: no queue of the
    door's streams was ahead of it, so the bound holds for the closed loop that follows."""
    limit = stream_limit.StreamLimit(target_s=2.0, high=64, initial=8)
    limit.observe(5.3, admitted_at=0.0, open_at_admission=0, now=5.3)
    assert limit.limit == 8 and not limit.slow_start
    assert limit.admits("interactive", 7)


def test_the_stream_limit_sheds_batch_first_and_drains_by_stream_turnover() -> None:
    limit = stream_limit.StreamLimit(target_s=2.0, high=64, initial=8, batch_share=0.75)
    assert limit.admits("batch", 5) and not limit.admits("batch", 6)
    assert limit.admits("interactive", 6)
    assert (limit.bound("interactive"), limit.bound("batch")) == (8, 6)
    assert stream_limit.drain_s(mean_stream_s=1.6, num_open=8) == pytest.approx(0.2)
    assert stream_limit.drain_s(mean_stream_s=0.0, num_open=8) == admission_rules.MIN_DRAIN_S
    assert stream_limit.drain_s(mean_stream_s=0.4, num_open=8) == admission_rules.MIN_DRAIN_S
    with pytest.raises(ValueError, match="decrease"):
        stream_limit.StreamLimit(target_s=2.0, high=8, decrease=1.0)
    with pytest.raises(ValueError, match="target_s"):
        stream_limit.StreamLimit(target_s=0.0, high=8)
    with pytest.raises(ValueError, match="low"):
        stream_limit.StreamLimit(target_s=1.0, high=0)
    assert stream_limit.StreamLimit(target_s=1.0, high=4, initial=8).limit == 4  # capped


def test_the_ingress_loop_lag_holds_the_stream_limit_but_a_first_token_never_cuts_on_it() -> None:
    """Past half its lag budget the bound stops growing; past the budget a first token in
    time still only holds it: those streams were served inside the SLO, and the loop's lag
    cuts only while the door answers 429s (``check_loop``)."""
    limit = stream_limit.StreamLimit(target_s=2.0, high=64, lag_budget_s=0.05, initial=10)
    limit.observe(0.2, admitted_at=0.0, open_at_admission=9, now=0.2, loop_lag_s=0.01)
    assert limit.limit == 11  # fast token, quiet loop, bound in use: grow
    limit.observe(0.2, admitted_at=1.0, open_at_admission=10, now=1.2, loop_lag_s=0.03)
    assert limit.limit == 11 and not limit.slow_start  # the loop starts to lag: hold
    limit.observe(0.2, admitted_at=2.0, open_at_admission=10, now=2.2, loop_lag_s=0.08)
    assert limit.limit == 11 and limit.sustained == 11  # past the budget: still held
    with pytest.raises(ValueError, match="lag_budget_s"):
        stream_limit.StreamLimit(target_s=2.0, high=8, lag_budget_s=0.0)
    assert signals.stream_lag_budget_s(0.1) == pytest.approx(0.1 / 6)  # 429s within 100 ms
    with pytest.raises(ValueError, match="reject_within_s"):
        signals.stream_lag_budget_s(0.0)


def test_a_first_token_the_decode_replica_predicted_late_does_not_cut_the_stream_limit() -> None:
    """A long prompt predicted at 2.6 s and served in 3.3 s is mostly the engine's work,
    not the path's queue: the bound holds (within the prediction + a quarter of the target,
    it would grow). The path's own delay past half the target still cuts."""
    limit = stream_limit.StreamLimit(target_s=2.0, high=64, initial=10)
    limit.observe(3.3, admitted_at=0.0, open_at_admission=9, now=3.3, predicted_s=2.6)
    assert limit.limit == 10 and not limit.slow_start  # held, not cut
    limit.observe(0.9, admitted_at=1.0, open_at_admission=9, now=1.9, predicted_s=0.5)
    assert limit.limit == pytest.approx(10.1)  # within prediction + a quarter: grows
    limit.observe(3.2, admitted_at=3.0, open_at_admission=9, now=6.2, predicted_s=2.0)
    assert limit.limit == pytest.approx(7.0)  # 1.2 s past the prediction: cut


def test_a_request_the_decode_replica_shed_cuts_the_stream_limit_once_per_round_trip() -> None:
    """Before any first token came in time: cut as for a late one (see the test below for
    the floor a sustained concurrency sets)."""
    limit = stream_limit.StreamLimit(target_s=2.0, high=64, initial=20)
    limit.refused(admitted_at=5.0, open_at_admission=19, now=5.1)
    assert limit.limit == pytest.approx(14) and not limit.slow_start
    limit.refused(admitted_at=5.05, open_at_admission=13, now=5.2)  # sent before the cut
    assert limit.limit == pytest.approx(14)
    limit.refused(admitted_at=5.3, open_at_admission=13, now=5.4)
    assert limit.limit == pytest.approx(0.7 * 14)
    limit.refused(admitted_at=5.5, open_at_admission=0, now=5.6)  # one stream: halved only
    assert limit.limit == pytest.approx(0.7 * 14 / 2)


def test_a_lagging_loop_cuts_the_stream_limit_at_the_door_at_most_every_quarter_target() -> None:
    """While the door refuses, the loop's lag cuts (at most every quarter of the target),
    halving at most, and never below the streams whose first tokens came in time."""
    limit = stream_limit.StreamLimit(target_s=2.0, high=64, lag_budget_s=0.025, initial=20)
    limit.check_loop(0.02, num_open=20, now=10.0)  # within the budget
    assert limit.limit == 20 and limit.slow_start
    limit.check_loop(0.04, num_open=20, now=10.1)
    assert limit.limit == pytest.approx(14) and not limit.slow_start
    limit.check_loop(0.05, num_open=14, now=10.3)  # within half a second of the last cut
    assert limit.limit == pytest.approx(14)
    limit.check_loop(0.05, num_open=3, now=10.6)  # few streams open: halved, no further
    assert limit.limit == pytest.approx(7)
    sustained = stream_limit.StreamLimit(target_s=2.0, high=64, lag_budget_s=0.025, initial=12)
    sustained.observe(1.5, admitted_at=0.0, open_at_admission=9, now=1.5)  # 10 in time
    sustained.check_loop(0.2, num_open=12, now=2.0)
    assert sustained.limit == 10  # 0.7 x 12 would refuse what was served in time


def test_the_ingress_waits_for_the_admission_decision_most_of_reject_within() -> None:
    """A request is 429'd by the ingress when the decode replica's decision has not come
    within half of reject_within from its arrival; one the ingress was slow to reach still
    gets a quarter of that."""
    from pdserve.deployments.admission.signals import admission_ack_timeout_s

    assert admission_ack_timeout_s(0.1, 0.0) == pytest.approx(0.05)
    assert admission_ack_timeout_s(0.1, 0.02) == pytest.approx(0.03)
    assert admission_ack_timeout_s(0.1, -1.0) == pytest.approx(0.05)  # clock skew: no credit
    assert admission_ack_timeout_s(0.1, 0.5) == pytest.approx(0.0125)
    with pytest.raises(ValueError, match="-0.1"):
        admission_ack_timeout_s(-0.1, 0.0)


def test_a_request_whose_own_work_misses_the_slo_is_served_when_nothing_is_ahead() -> None:
    """A long prompt on an idle replica: shedding it would shed every retry too (waiting
    cannot shorten its own work), so it is admitted and counted as past its SLO; behind a
    queue it is shed until that queue has drained, not for as long as its own work."""
    own = admission_rules.predict_ttft(ahead(), 2000)  # 4 s of prefill alone, over 3 s
    idle = admission_rules.decide(own, "interactive", RULES)
    assert idle.action == "admit" and idle.reason == "idle_past_slo" and idle.past_slo
    assert idle.predicted_ttft_s > RULES.threshold_s("interactive")
    busy = admission_rules.predict_ttft(ahead(queued_prefill_tokens=250), 2000)  # 0.5 s ahead
    shed = admission_rules.decide(busy, "interactive", RULES)
    assert shed.action == "shed" and shed.reason == "ttft_slo"
    assert shed.retry_after_s == pytest.approx(0.5)  # the queue ahead's drain, not 1.55 s
    # A request that fits is still admitted plainly, and a short one behind a short queue too.
    fits = admission_rules.decide(admission_rules.predict_ttft(ahead(), 100), "interactive", RULES)
    assert fits.reason == "admitted" and not fits.past_slo


def test_only_a_late_first_token_cuts_below_the_concurrency_served_in_time() -> None:
    """Ten streams open and a first token in time: a decode replica's shed and a lagging
    loop at the door cut no lower than ten; a late first token behind nine others shows ten
    missing the target, and then the bound and what counts as sustained fall together."""
    limit = stream_limit.StreamLimit(target_s=2.0, high=64, lag_budget_s=0.02, initial=12)
    limit.observe(1.2, admitted_at=0.0, open_at_admission=9, now=1.2)
    assert limit.sustained == 10
    limit.refused(admitted_at=2.0, open_at_admission=11, now=2.1)
    assert limit.limit == 10  # 0.7 x 12 = 8.4 would refuse two streams served in time
    limit.check_loop(0.1, num_open=10, now=3.0)
    assert limit.limit == 10
    limit.observe(2.6, admitted_at=3.5, open_at_admission=9, now=6.1)  # late, at ten
    assert limit.limit == pytest.approx(7) and limit.sustained == 7
    limit.refused(admitted_at=6.5, open_at_admission=6, now=6.6)
    assert limit.limit == pytest.approx(7)  # held at the new sustained level


def test_requests_arriving_together_are_admitted_only_up_to_the_stream_bound() -> None:
    """A burst reaches the door before any of its requests opens a stream (the ingress reads,
    parses and tokenizes each body in between): the door lets through only what the bound
    holds, each pass counting from the door check. A pass whose request never opens a
    stream (a bad body) frees its place; one that opened is counted once, as its stream."""
    from pdserve.deployments.admission.front_door import (
        DoorPass,
        DoorShed,
        FrontDoor,
        FrontDoorSettings,
    )
    from tests.deployments.admission_fakes import DoorRecord, FakeLoopLag

    record = DoorRecord()
    door = FrontDoor(
        FrontDoorSettings(ttft_slo_s=2.0, max_streams=16),
        record,
        record.reported.append,
        stream_limit.StreamLimit(2.0, high=16, initial=4),
        loop_lag=FakeLoopLag(),
        clock=lambda: 0.0,
    )
    burst = [door.admit("interactive") for _ in range(400)]
    passes = [p for p in burst if isinstance(p, DoorPass)]
    assert len(passes) == 4 and door.num_open == 0
    assert record.sheds == ["concurrency"] * 396
    assert all(isinstance(p, DoorShed) for p in burst[4:])

    door.release(passes[0])  # its body was bad: no stream
    door.release(passes[0])  # released once only
    tickets = [door.opened("interactive", p) for p in passes[1:]]
    assert [t.open_before for t in tickets] == [2, 2, 2]  # the two others, once each
    assert door.num_open == 3 and door.num_passed == 0
    fourth = door.admit("interactive")  # the bad body's place is free again
    assert isinstance(fourth, DoorPass)
    assert isinstance(door.admit("interactive"), DoorShed)
    door.opened("interactive", fourth)
    door.opened("interactive", fourth)  # a second choice (n = 2) is a stream of its own
    assert door.num_open == 5 and door.num_passed == 0


def test_the_concurrency_served_in_time_stops_flooring_the_bound_after_its_window() -> None:
    """Ten streams in time set a floor for ten round trips (ten targets); confirmed again,
    it holds on; not seen again within the window, it expires, and a shed cuts the bound
    as if it had never been seen. A lower level seen since is what remains."""
    limit = stream_limit.StreamLimit(target_s=2.0, high=64, lag_budget_s=0.02, initial=12)
    assert limit.sustained_window_s == pytest.approx(20.0)
    limit.observe(1.2, admitted_at=0.0, open_at_admission=9, now=1.2)  # ten in time
    limit.observe(0.8, admitted_at=10.0, open_at_admission=3, now=10.8)  # four in time
    limit.refused(admitted_at=20.0, open_at_admission=11, now=21.0)  # within the window
    assert limit.sustained == 10 and limit.limit == 10
    limit.observe(1.0, admitted_at=20.0, open_at_admission=9, now=21.1)  # ten again
    limit.check_loop(0.1, num_open=10, now=40.0)
    assert limit.sustained == 10 and limit.limit == 10  # confirmed at 21.1: still held
    limit.refused(admitted_at=42.0, open_at_admission=9, now=42.0)  # 20.9 s after
    assert limit.sustained == 0 and limit.limit == pytest.approx(7)  # 0.7 x 10, no floor
    with pytest.raises(ValueError, match="sustained_window_s"):
        stream_limit.StreamLimit(target_s=2.0, high=8, sustained_window_s=0.0)


def test_a_late_first_token_caps_every_level_the_window_remembers() -> None:
    """A late first token at seven streams caps what the window holds: neither the ten of
    before nor the eight seen after it (as the window's later maximum) floors above seven."""
    limit = stream_limit.StreamLimit(target_s=2.0, high=64, initial=12)
    limit.observe(1.0, admitted_at=0.0, open_at_admission=9, now=1.0)
    limit.observe(1.0, admitted_at=1.5, open_at_admission=7, now=2.5)
    limit.observe(3.0, admitted_at=3.0, open_at_admission=9, now=6.0)  # late at ten
    assert limit.limit == pytest.approx(7) and limit.sustained == 7
    limit.observe(1.0, admitted_at=6.5, open_at_admission=4, now=7.5)  # five in time
    limit.refused(admitted_at=24.0, open_at_admission=6, now=24.0)  # both 7s expired
    assert limit.sustained == 5 and limit.limit == pytest.approx(5)
