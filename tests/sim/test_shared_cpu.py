"""Engines on the CPUs the serving processes share: the measured model, by hand."""

from __future__ import annotations

import pytest

from pdserve.deployments.config import AppConfig
from pdserve.sim.cluster import SimCluster
from pdserve.sim.config import SharedCpuSettings, SimSettings
from pdserve.sim.cpu_account import group_key, serving_cpu_s
from pdserve.sim.events import EventLoop
from pdserve.sim.request import SimRequest
from pdserve.sim.shared_cpu import (
    HelperThreadsCost,
    SharedCpuCost,
    SharedCpuLoad,
    measured_settings,
    streams_per_step,
)
from tests.sim.fakes import LinearCost

PLAN = {"shared_cpus": [0], "prefill_engine_cpus": [], "decode_engine_cpus": [1]}


def _disagg(**over: object) -> AppConfig:
    base: dict[str, object] = {
        "model": {"test_model": "small", "device": "cpu"},
        "prefill": {"min_replicas": 1, "max_replicas": 1},
        "decode": {"min_replicas": 1, "max_replicas": 1},
        "policy": {"mode": "always_remote"},
        "router": {"default_prefill_tokens_per_s": 1000.0},
        "autoscaling": False,
    }
    return AppConfig.from_dict(base | over)


def test_the_serving_work_queues_on_the_shared_cpu_and_a_niced_engine_gets_the_rest() -> None:
    loop = EventLoop()
    tokens = [0.0]
    cpu = SharedCpuSettings(
        roles=("prefill",), s_per_request=0.18, s_per_output_token=0.002, background=0.1
    )
    load = SharedCpuLoad(cpu, loop, lambda: tokens[0])
    assert load.capacity == pytest.approx(0.9)  # the daemons take 0.1 of the one CPU
    assert load.share() == pytest.approx(0.9) and load.delay() == 0.0
    load.arrived()  # 0.18 s of work queued: the niced engine gets a sliver until it is done
    assert load.share() == pytest.approx(0.02)
    assert load.delay() == pytest.approx(0.18 / 0.9)
    loop.run(until=0.19)
    assert load.share() == pytest.approx(0.02)
    loop.run(until=0.21)  # cleared at 0.18 / 0.9 = 0.2 s
    assert load.share() == pytest.approx(0.9) and load.delay() == 0.0
    cost = SharedCpuCost(LinearCost(0.001), load)
    assert cost.step_s(90, 0.0, 0, 0) == pytest.approx(0.09 / 0.9)
    assert cost.kv_bytes_per_token == 1 and cost.transfer_s(100) == 0.0
    tokens[0] = 200.0  # streaming 200 tokens/s x 2 ms: 0.4 of the CPU, none queued
    load.tokens_changed()
    assert load.share() == pytest.approx(1 - 0.1 - 0.4) and load.delay() == 0.0
    tokens[0] = 500.0  # 1.0 CPU of streaming > 0.9: 0.1 s of work more queued each second
    load.tokens_changed()
    loop.run(until=1.21)
    assert load.delay() == pytest.approx(0.1 / 0.9) and load.share() == pytest.approx(0.02)
    tokens[0] = 0.0  # the batch finished: the 0.1 s queued clears in 0.1 / 0.9 s
    load.tokens_changed()
    loop.run(until=1.21 + 0.1 / 0.9 + 1e-6)
    assert load.share() == pytest.approx(0.9) and load.delay() == 0.0
    # Per prompt token: a 500-token prompt at 0.2 ms each queues 0.1 s more than its 0.18 s.
    per_token = cpu.model_copy(update={"s_per_prompt_token": 0.0002})
    load = SharedCpuLoad(per_token, loop)
    load.arrived(500)
    assert load.delay() == pytest.approx((0.18 + 0.1) / 0.9)


def test_a_request_reaches_the_engines_once_its_serving_work_is_done_hand_computed() -> None:
    # The request's own 0.09 s of serving work (of a CPU with 0.1 taken by the daemons)
    # takes 0.1 s, and only then is it routed: the niced prefill computes its 0.3 s at the
    # 0.9 the daemons leave. The decode step (own CPU) is 1 ms.
    cpu = SharedCpuSettings(roles=("prefill",), s_per_request=0.09, background=0.1)
    settings = SimSettings(rpc_s=0.0, ingress_s=0.0, shared_cpu=cpu)
    for shared, ttft in ((None, 0.301), (cpu, 0.1 + 0.3 / 0.9 + 0.001)):
        req = SimRequest(0, 0.0, prompt_tokens=300, output_tokens=2)
        s = settings.model_copy(update={"shared_cpu": shared})
        SimCluster(_disagg(), LinearCost(0.001), LinearCost(0.001), s).run([req])
        assert req.ttft == pytest.approx(ttft, abs=1e-9)


def test_tokens_streamed_faster_than_the_shared_cpu_carries_reach_the_client_late() -> None:
    # 10-token prompt: prefilled in 10 ms, its KV lands and the decode engine (own CPU)
    # emits one token per 1 ms: 1000 tokens/s x 2 ms = 2 CPUs of streaming on 1. The first
    # token (engine: 11 ms) waits behind 1 ms x (2 - 1) of work; the last (engine: 109 ms)
    # behind 99 ms of it: the client sees 2 ms per token, the engine computed 1 ms.
    cpu = SharedCpuSettings(roles=("prefill",), s_per_request=0.0, s_per_output_token=0.002)
    s = SimSettings(rpc_s=0.0, ingress_s=0.0, shared_cpu=cpu)
    req = SimRequest(0, 0.0, prompt_tokens=10, output_tokens=100)
    SimCluster(_disagg(), LinearCost(0.001), LinearCost(0.001), s).run([req])
    assert req.first_token_at == pytest.approx(0.011 + 0.001, abs=1e-9)
    assert req.finished_at == pytest.approx(0.109 + 0.099, abs=1e-9)
    assert req.tpot == pytest.approx((0.208 - 0.012) / 99)


def _cpu_json(idle_shared_s: float, run_shared_s: float, wall_s: float) -> dict:
    return {
        "plan": PLAN,
        "idle": {"wall_s": 10.0, "groups_s": {group_key((0,), False): idle_shared_s}},
        "run": {
            "wall_s": wall_s,
            "groups_s": {
                group_key((0,), False): run_shared_s,  # the serving path
                group_key((0,), True): 40.0,  # the niced prefill engine itself
                group_key((1,), False): 50.0,  # the decode engine on its own CPU
                group_key((0, 1), False): 5.0,  # unpinned (the benchmark client)
            },
        },
    }


def test_the_serving_cost_per_request_is_measured_net_of_the_idle_daemons() -> None:
    run = _cpu_json(1.0, 30.0, 100.0)
    assert serving_cpu_s(run["run"], (0,)) == pytest.approx(30.0)
    # Daemons: 1 s in 10 s idle = 0.1; the run's 30 s less 0.1 x 100 s over 40 requests =
    # 0.5 s each; a second run of 20 requests: (13 - 0.1 x 50) / 20 = 0.4 s; mean 0.45 s.
    cpu = measured_settings(_disagg(), [(run, 40), (_cpu_json(1.0, 13.0, 50.0), 20)])
    assert cpu is not None
    assert cpu.roles == ("prefill",) and cpu.num_cpus == 1
    assert (cpu.background, cpu.s_per_request) == (pytest.approx(0.1), pytest.approx(0.45))
    # Colocated: no engine computes on the shared CPU (the decode engine has CPU 1).
    colocated = _disagg(policy={"mode": "always_local"}, prefill={"min_replicas": 0})
    assert measured_settings(colocated, [(run, 40)]) is None
    assert measured_settings(_disagg(), []) is None


def test_cpu_snapshot_groups_threads_by_allowed_cpus_and_niceness(tmp_path) -> None:
    import os

    from pdserve.sim.cpu_account import CpuSnapshot

    tick = os.sysconf("SC_CLK_TCK")

    def thread(pid: int, tid: int, comm: str, ticks: int, nice: int, cpus: str) -> None:
        task = tmp_path / str(pid) / "task" / str(tid)
        task.mkdir(parents=True)
        # pid (comm) state, then fields 4..: utime is field 14, stime 15, nice 19.
        rest = ["0"] * 10 + [str(ticks), str(ticks)] + ["0"] * 3 + [str(nice)] + ["0"] * 30
        (task / "stat").write_text(f"{tid} ({comm}) S {' '.join(rest)}\n")
        (task / "status").write_text(f"Name:\t{comm}\nCpus_allowed_list:\t{cpus}\n")

    thread(10, 10, "ray::Ingress", tick, 0, "0")
    thread(10, 11, "asyncio) x", tick, 0, "0")  # a ')' in the name
    thread(20, 21, "prefill", 3 * tick, 19, "0")
    thread(30, 31, "decode", 2 * tick, 0, "1")
    (tmp_path / "stat").write_text(
        "cpu  9 9 9 9 9 9 9 9 0 0\n"
        f"cpu0 {tick} 0 {tick} {5 * tick} {tick} 0 0 0 0 0\n"
        f"cpu1 {2 * tick} 0 0 0 0 0 0 0 0 0\n"
    )
    snap = CpuSnapshot.take(tmp_path)
    assert snap.groups == {
        "cpus=0;nice0": pytest.approx(4.0),  # 2 threads x (1 s user + 1 s system)
        "cpus=0;niced": pytest.approx(6.0),
        "cpus=1;nice0": pytest.approx(4.0),
    }
    assert snap.busy == {0: pytest.approx(2.0), 1: pytest.approx(2.0)}  # idle, iowait out


def test_the_engine_process_per_request_work_holds_up_its_prompt_hand_computed() -> None:
    # Nothing else on the shared CPU: the 300-token prompt computes in 0.3 s, then the
    # prefill process spends its measured 0.1 s (RPC, KV send) before the KV is out; the
    # decode replica's first step is 1 ms. Without that work: 0.301 s.
    for extra, per_token, ttft in ((0.0, 0.0, 0.301), (0.1, 0.0, 0.401), (0.04, 0.0002, 0.401)):
        cpu = SharedCpuSettings(
            roles=("prefill",),
            s_per_request=0.0,
            engine_s_per_request=extra,
            engine_s_per_prompt_token=per_token,  # x 300 tokens: 0.06 s
        )
        s = SimSettings(rpc_s=0.0, ingress_s=0.0, shared_cpu=cpu)
        req = SimRequest(0, 0.0, prompt_tokens=300, output_tokens=2)
        SimCluster(_disagg(), LinearCost(0.001), LinearCost(0.001), s).run([req])
        assert req.ttft == pytest.approx(ttft, abs=1e-9)


def test_a_decoding_request_slows_the_next_prefill_on_the_shared_cpu() -> None:
    # a (100-token prompt, 1000 outputs) prefills in 0.1 s with nothing decoding, then
    # decodes one token per 1 ms step: 1000 tokens/s x 0.5 ms of serving CPU each = half
    # the shared CPU. b's 300-token prompt, starting at 0.2 s, takes 0.3 s / 0.5 = 0.6 s;
    # its first token follows within the decode replica's next steps (1-2 ms each).
    cpu = SharedCpuSettings(roles=("prefill",), s_per_request=0.0, s_per_output_token=0.0005)
    s = SimSettings(rpc_s=0.0, ingress_s=0.0, shared_cpu=cpu)
    a = SimRequest(0, 0.0, prompt_tokens=100, output_tokens=1000)
    b = SimRequest(1, 0.2, prompt_tokens=300, output_tokens=2)
    SimCluster(_disagg(), LinearCost(0.001), LinearCost(0.001), s).run([a, b])
    assert a.ttft == pytest.approx(0.101, abs=1e-9)
    assert b.ttft == pytest.approx(0.6, abs=0.004)
    # Once a finished (at about 1.1 s) nothing decodes: a third prompt gets the whole CPU.
    c = SimRequest(2, 2.0, prompt_tokens=300, output_tokens=2)
    a2 = SimRequest(0, 0.0, prompt_tokens=100, output_tokens=1000)
    SimCluster(_disagg(), LinearCost(0.001), LinearCost(0.001), s).run([a2, c])
    assert c.ttft == pytest.approx(0.301, abs=1e-9)


def _calibrated_cpu_json() -> dict:
    def usage(wall: float, serving: float, engine: float) -> dict:
        return {
            "wall_s": wall,
            "groups_s": {group_key((0,), False): serving, group_key((0,), True): engine},
        }

    run = _cpu_json(1.0, 30.0, 100.0)
    run["idle"]["groups_s"][group_key((0,), True)] = 0.5  # the idle prefill process: 5 %
    run["calibration"] = {
        # 10 requests of 1 output token in 20 s: 4 s of serving CPU, less 0.1 x 20 s of
        # daemons = 0.2 s each; prefill process 4 s, less 0.05 x 20 s idle, less 10 x 0.2 s
        # of profiled compute = 1 s over 10 requests.
        "short": {"requests": 10, "prompt_tokens": 64, "output_tokens": 1,
                  "failed": 0, "usage": usage(20.0, 4.0, 4.0)},
        # 10 requests of 51 tokens in 40 s: 14 s less 4 s of daemons = 1 s each, 0.8 s more
        # than the short ones for 50 more tokens: 16 ms per token; the short ones' 0.2 s is
        # then 16 ms for its token + 184 ms per request. Prefill process: 5 s less 2 s idle
        # less 2 s of compute = 1 s over 10 requests: (1 + 1) / 20 = 0.1 s per request.
        "long": {"requests": 10, "prompt_tokens": 64, "output_tokens": 51,
                 "failed": 0, "usage": usage(40.0, 14.0, 5.0)},
    }  # fmt: skip
    return run


def _with_prompt_batch(run: dict) -> dict:
    run["calibration"]["prompt"] = {
        # 10 requests of 464-token prompts, 1 output token, in 30 s: serving 7 s less 3 s of
        # daemons = 0.4 s each, 0.2 s more than "short" for 400 more prompt tokens: 0.5 ms
        # each; per request 0.2 - 16 ms - 64 x 0.5 ms = 152 ms. Prefill process: 19 s less
        # 1.5 s idle less 10 x 464 / 320 s of compute = 0.3 s each, against 0.1 s with
        # 64-token prompts: 0.5 ms per prompt token, and 0.1 - 64 x 0.5 ms = 68 ms each.
        "requests": 10, "prompt_tokens": 464, "output_tokens": 1, "failed": 0,
        "usage": {
            "wall_s": 30.0,
            "groups_s": {group_key((0,), False): 7.0, group_key((0,), True): 19.0},
        },
    }  # fmt: skip
    return run


def test_the_calibration_splits_the_serving_cpu_into_requests_and_tokens() -> None:
    cpu = measured_settings(_disagg(), [(_calibrated_cpu_json(), 40)], lambda n: n / 320)
    assert cpu is not None
    assert cpu.background == pytest.approx(0.1)
    assert cpu.s_per_output_token == pytest.approx(0.016)
    assert cpu.s_per_request == pytest.approx(0.184)
    assert cpu.engine_s_per_request == pytest.approx(0.1)
    # Without the profile's compute the engine process's extra is not worked out.
    assert measured_settings(_disagg(), [(_calibrated_cpu_json(), 40)]).engine_s_per_request == 0
    # A third batch with longer prompts splits off what each prompt token costs.
    cpu = measured_settings(
        _disagg(), [(_with_prompt_batch(_calibrated_cpu_json()), 40)], lambda n: n / 320
    )
    assert cpu is not None
    assert cpu.s_per_output_token == pytest.approx(0.016)
    assert cpu.s_per_prompt_token == pytest.approx(0.0005)
    assert cpu.s_per_request == pytest.approx(0.2 - 0.016 - 64 * 0.0005)
    assert cpu.engine_s_per_prompt_token == pytest.approx(0.0005)
    assert cpu.engine_s_per_request == pytest.approx(0.1 - 64 * 0.0005)
    # Colocated (the engine on its own CPU): only the serving path's queue is modelled.
    colocated = _disagg(policy={"mode": "always_local"}, prefill={"min_replicas": 0})
    only_streams = measured_settings(colocated, [(_calibrated_cpu_json(), 40)])
    assert only_streams is not None and only_streams.roles == ()
    assert only_streams.s_per_output_token == pytest.approx(0.016)


def test_streams_per_step_is_the_time_average_of_the_open_streams_while_any_is() -> None:
    records = [
        {"ok": True, "send_time": 0.0, "ttft": 1.0, "e2e": 3.0},  # streams over [1, 3]
        {"ok": True, "send_time": 1.0, "ttft": 1.0, "e2e": 4.0},  # [2, 5]
        {"ok": True, "send_time": 10.0, "ttft": 1.0, "e2e": 2.0},  # [11, 12]
        {"ok": False, "send_time": 2.0, "ttft": None, "e2e": None},
    ]
    # 1 stream over [1, 2], 2 over [2, 3], 1 over [3, 5] and [11, 12]: 6 stream-seconds in
    # the 5 s that any streams (the gap [5, 11] does not count).
    assert streams_per_step(records) == pytest.approx(6 / 5)
    assert streams_per_step(records[3:]) is None


def _with_streams_batch(run: dict, measured: float | None) -> dict:
    # The long batch 4 at a time: 10 requests of 51 tokens in 20 s, serving 7.5 s less 2 s
    # of daemons = 0.55 s each, 0.35 s more than "short" for 50 more tokens: 7 ms a token
    # in steps of 4 streams against 16 ms in steps of 1. So per token t + s / 1 = 16 ms and
    # t + s / 4 = 7 ms: 12 ms per step and 4 ms per token.
    run["calibration"]["streams"] = {
        "requests": 10, "prompt_tokens": 64, "output_tokens": 51, "failed": 0,
        "concurrency": 4, "streams_per_step": measured,
        "usage": {"wall_s": 20.0, "groups_s": {group_key((0,), False): 7.5}},
    }  # fmt: skip
    return run


def test_a_calibration_batch_of_concurrent_streams_splits_tokens_from_steps() -> None:
    for measured in (4.0, None):  # measured, or the batch's concurrency when not
        cpu = measured_settings(
            _disagg(), [(_with_streams_batch(_calibrated_cpu_json(), measured), 40)]
        )
        assert cpu is not None
        assert cpu.s_per_decode_step == pytest.approx(0.012)
        assert cpu.s_per_output_token == pytest.approx(0.004)
        assert cpu.s_per_request == pytest.approx(0.184)  # its one token: a step of one
    # Fewer streams per step than the concurrency (the others still prefilling): the same
    # 7 ms a token is then a larger share per step: t + s = 16, t + s / 2 = 7 ms.
    cpu = measured_settings(_disagg(), [(_with_streams_batch(_calibrated_cpu_json(), 2.0), 40)])
    assert cpu is not None
    assert cpu.s_per_decode_step == pytest.approx(0.016)  # (16 - 7) / (1 - 1/2) = 18, capped
    assert cpu.s_per_output_token == pytest.approx(0.0)


def test_the_serving_demand_counts_decode_steps_and_tokens() -> None:
    loop = EventLoop()
    rates = {"tokens": 0.0, "steps": 0.0}
    cpu = SharedCpuSettings(
        roles=("prefill",),
        s_per_request=0.0,
        s_per_output_token=0.002,
        s_per_decode_step=0.004,
        background=0.1,
    )
    load = SharedCpuLoad(cpu, loop, lambda: rates["tokens"], lambda: rates["steps"])
    rates.update(tokens=200.0, steps=50.0)  # batches of 4: 0.4 + 0.2 of the CPU
    load.tokens_changed()
    assert load.share() == pytest.approx(1 - 0.1 - 0.4 - 0.2)
    rates.update(tokens=100.0, steps=100.0)  # batches of 1: 0.2 + 0.4
    load.tokens_changed()
    assert load.share() == pytest.approx(1 - 0.1 - 0.2 - 0.4)


def test_helper_threads_add_the_share_of_their_measured_speed_up_hand_computed() -> None:
    loop = EventLoop()
    cpu = SharedCpuSettings(roles=(), s_per_request=0.09, background=0.1)
    load = SharedCpuLoad(cpu, loop)
    # Profiles: 2 ms per token alone, 1 ms with the helper at full speed (a gain of 1).
    cost = HelperThreadsCost(LinearCost(0.002), LinearCost(0.001), load, min_tokens=32)
    assert cost.step_s(100, 0.0, 0, 0) == pytest.approx(0.2 / (1 + 0.9))
    assert cost.rescale_factor(0.9, 0.02) == pytest.approx(1.9 / 1.02)
    assert cost.step_s(10, 0.0, 0, 0) == pytest.approx(0.02)  # too small for the helper
    assert cost.rescale_factor(0.9, 0.02) == 1.0


def test_a_colocated_prompt_with_a_helper_thread_hand_computed() -> None:
    # 300 tokens: 0.3 s alone, 0.15 s with the helper at full speed. The request's 0.09 s
    # of serving work holds the shared CPU for 0.1 s before it reaches the engine; then the
    # helper gets 0.9: the 0.3 s at 1.9x.
    app = _disagg(
        policy={"mode": "always_local"},
        prefill={"min_replicas": 0, "max_replicas": 1},
        decode={"min_replicas": 1, "max_replicas": 1, "cpu": {"helper_threads": 1}},
    )
    cpu = SharedCpuSettings(roles=(), s_per_request=0.09, background=0.1)
    s = SimSettings(rpc_s=0.0, ingress_s=0.0, shared_cpu=cpu)
    req = SimRequest(0, 0.0, prompt_tokens=300, output_tokens=2)
    cluster = SimCluster(
        app, LinearCost(0.001), LinearCost(0.001), s, helper_costs={"decode": LinearCost(0.0005)}
    )
    cluster.run([req])
    assert req.placement == "local"
    assert req.ttft == pytest.approx(0.1 + 0.3 / 1.9, abs=1e-9)
    assert req.finished_at - req.first_token_at == pytest.approx(0.001)  # 1 token: no helper
