"""Engines on the CPUs the serving processes share: the measured model, by hand."""

from __future__ import annotations

import pytest

from pdserve.deployments.config import AppConfig
from pdserve.sim.cluster import SimCluster
from pdserve.sim.config import SharedCpuSettings, SimSettings
from pdserve.sim.cpu_account import group_key, serving_cpu_s
from pdserve.sim.request import SimRequest
from pdserve.sim.shared_cpu import SharedCpuCost, SharedCpuLoad, measured_settings
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


def test_a_step_on_the_shared_cpu_takes_its_time_over_the_share_left() -> None:
    now = [0.0]
    cpu = SharedCpuSettings(roles=("prefill",), s_per_request=0.2, background=0.1)
    load = SharedCpuLoad(cpu, lambda: now[0])
    assert load.share() == pytest.approx(0.9)  # the daemons alone
    for _ in range(20):  # 2 requests/s over the 10 s window: 0.4 s of CPU per second
        load.arrived()
    assert load.share() == pytest.approx(1 - 0.1 - 0.4)
    cost = SharedCpuCost(LinearCost(0.001), load)
    assert cost.step_s(100, 0.0, 0, 0) == pytest.approx(0.1 / 0.5)
    assert cost.kv_bytes_per_token == 1 and cost.transfer_s(100) == 0.0
    for _ in range(100):  # far more than the CPU: a sliver is left, never nothing
        load.arrived()
    assert load.share() == pytest.approx(0.02)
    now[0] = 11.0  # the arrivals left the window
    assert load.share() == pytest.approx(0.9)


def test_a_prefill_replica_on_the_shared_cpu_prefills_slower_hand_computed() -> None:
    # One request: 1/10 s over the window, 5 s of serving CPU each -> half the CPU is left,
    # so its 300-token prompt takes 0.6 s instead of 0.3 s; the decode replica (own CPU)
    # then computes its first token in 1 ms.
    cpu = SharedCpuSettings(roles=("prefill",), s_per_request=5.0)
    settings = SimSettings(rpc_s=0.0, ingress_s=0.0, shared_cpu=cpu)
    for shared, ttft in ((None, 0.301), (cpu, 0.601)):
        req = SimRequest(0, 0.0, prompt_tokens=300, output_tokens=2)
        s = settings.model_copy(update={"shared_cpu": shared})
        SimCluster(_disagg(), LinearCost(0.001), LinearCost(0.001), s).run([req])
        assert req.ttft == pytest.approx(ttft, abs=1e-9)


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
