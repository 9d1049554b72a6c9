"""The `pdserve` command line without a cluster: arguments, config errors, state handling,
topology rules and stopping process sessions by pid."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cluster import cli
from pdserve.cluster.procs import is_running, session_members, stop_sessions
from pdserve.cluster.serving import (
    bind_front_door,
    curl_example,
    grpc_example,
    resolve_model,
    wait_for_http,
)
from pdserve.cluster.state import ClusterState, NodeRecord, ServeRecord, load_state, save_state
from pdserve.cluster.topology import ClusterSpec, format_labels
from pdserve.deployments.config import AppConfig
from tests.support import wait_until


def test_run_parses_config_and_cluster_flags(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(
        ["run", "my.yaml", "--prefill-cpus", "2", "--state-dir", str(tmp_path)]
    )
    assert (args.command, args.config, args.prefill_cpus, args.state_dir) == (
        "run",
        Path("my.yaml"),
        2,
        tmp_path,
    )
    assert args.decode_cpus is None and args.deploy_timeout == 600.0
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["up", "--deploy-timeout", "5"])  # a serve flag
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--start-timeout", "-1"])


def test_state_dir_flag_beats_env_beats_default(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(cli.STATE_DIR_ENV, raising=False)
    assert cli.resolve_state_dir(None) == tmp_path / "xdg" / "pdserve"
    monkeypatch.setenv(cli.STATE_DIR_ENV, str(tmp_path / "env"))
    assert cli.resolve_state_dir(None) == tmp_path / "env"
    assert cli.resolve_state_dir(tmp_path / "flag") == tmp_path / "flag"


def test_commands_without_a_cluster(tmp_path: Path, capsys) -> None:
    state = ["--state-dir", str(tmp_path)]
    assert cli.main(["down", *state]) == 0
    assert "nothing to stop" in capsys.readouterr().out
    assert cli.main(["status", *state]) == 1
    assert cli.main(["serve", *state]) == 1
    assert "run `pdserve up` first" in capsys.readouterr().err


def test_bad_config_or_cpus_fail_before_anything_starts(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode:\n  min_replica: 2\n")
    state = ["--state-dir", str(tmp_path / "state")]
    assert cli.main(["run", str(bad), *state]) == 2
    assert "decode.min_replica: unknown field" in capsys.readouterr().err
    assert cli.main(["run", str(tmp_path / "missing.yaml"), *state]) == 2
    assert cli.main(["up", "--prefill-cpus", "0", *state]) == 2
    assert "prefill_cpus" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


def test_topology_splits_cores_between_pools(monkeypatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    spec = ClusterSpec.for_this_machine()
    assert [(n.name, n.num_cpus, n.labels) for n in spec.nodes()] == [
        ("head", 0, {}),
        ("prefill", 1, {"pdserve.io/pool": "prefill"}),
        ("decode", 1, {"pdserve.io/pool": "decode"}),
    ]
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    spec = ClusterSpec.for_this_machine(decode_cpus=5)
    assert (spec.prefill_cpus, spec.decode_cpus) == (3, 5)
    spec = ClusterSpec.for_this_machine(prefill_gpus=1, decode_gpus=1)
    assert [n.num_gpus for n in spec.nodes()] == [0, 1, 1]
    with pytest.raises(ValueError, match="node_ip"):
        ClusterSpec(prefill_cpus=1, decode_cpus=1, node_ip="127.0.0.1")
    with pytest.raises(ValueError, match="object_store_mib"):
        ClusterSpec(prefill_cpus=1, decode_cpus=1, object_store_mib=10)
    assert format_labels({"a": "1", "b": "2"}) == "a=1,b=2"
    with pytest.raises(ValueError, match="labels"):
        format_labels({"a": "1,b=2"})


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU pinning is Linux-only")
def test_cpu_plan_gives_engines_cpus_of_their_own() -> None:
    def plan(cpus: int, prefill: int, decode: int, **kw: object):
        spec = ClusterSpec(
            prefill_cpus=prefill, decode_cpus=decode, machine_cpus=tuple(range(cpus)), **kw
        )
        return spec, spec.cpu_plan()

    # 2 cores: the decode engine owns CPU 1; prefill engines share CPU 0 with the rest.
    spec, p = plan(2, 1, 2)
    assert (p.shared_cpus, p.prefill_engine_cpus, p.decode_engine_cpus) == ((0,), (), (1,))
    assert [(n.cpus, n.engine_cpus) for n in spec.nodes()] == [
        ((0,), ()),
        ((0,), ()),
        ((0,), (1,)),
    ]
    _, p = plan(4, 2, 2)
    assert (p.shared_cpus, p.prefill_engine_cpus, p.decode_engine_cpus) == ((0,), (1,), (2, 3))
    _, p = plan(8, 3, 3)
    assert (p.shared_cpus, p.prefill_engine_cpus, p.decode_engine_cpus) == (
        (0, 1),
        (2, 3, 4),
        (5, 6, 7),
    )
    assert plan(1, 1, 1)[1] is None  # nothing to spare
    # GPU pools compute on their GPU: nothing reserved for them.
    _, p = plan(8, 3, 3, decode_gpus=1)
    assert (p.shared_cpus, p.prefill_engine_cpus, p.decode_engine_cpus) == (
        (0, 1, 2, 3, 4),
        (5, 6, 7),
        (),
    )
    assert plan(8, 3, 3, decode_gpus=1, prefill_gpus=1)[1] is None
    spec, p = plan(4, 2, 2, pin_cpus=False)
    assert p is None and all(n.cpus == () and n.engine_cpus == () for n in spec.nodes())


def test_pinned_nodes_start_on_the_shared_cpus_with_their_reservation(tmp_path: Path) -> None:
    from pdserve.cluster.local import _affinity_setter, _node_env

    spec = ClusterSpec(prefill_cpus=1, decode_cpus=1, machine_cpus=(0, 1))
    head, prefill, decode = spec.nodes()
    os.environ["PDSERVE_ENGINE_CPUS"] = "7"  # a stray value in the caller's environment
    try:
        assert _node_env(tmp_path / "t", decode)["PDSERVE_ENGINE_CPUS"] == "1"
        assert "PDSERVE_ENGINE_CPUS" not in _node_env(tmp_path / "t", prefill)
    finally:
        del os.environ["PDSERVE_ENGINE_CPUS"]
    assert _affinity_setter(()) is None
    assert _affinity_setter(head.cpus) is not None


def test_direct_ingress_flag_reaches_every_node_and_only_when_asked(
    tmp_path: Path, monkeypatch
) -> None:
    from pdserve.cluster.local import DIRECT_INGRESS_ENV, _node_env
    from pdserve.deployments.door_gate import EDGE_CALLBACK

    args = cli.build_parser().parse_args(["up", "--direct-ingress", "--prefill-cpus", "1"])
    spec = cli._cluster_spec(args)
    assert spec.direct_ingress
    assert not cli._cluster_spec(cli.build_parser().parse_args(["up"])).direct_ingress
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1")  # stray, in the caller's env
    for node in spec.nodes():
        env = _node_env(tmp_path / "t", node, direct_ingress=True)
        assert {k: env[k] for k in DIRECT_INGRESS_ENV} == DIRECT_INGRESS_ENV
        assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in _node_env(tmp_path / "t", node)
        # Serve's HTTP servers run pdserve's EdgeGate, with direct ingress or without.
        for direct in (True, False):
            env = _node_env(tmp_path / "t", node, direct_ingress=direct)
            assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == EDGE_CALLBACK


def test_front_door_binds_cluster_address_unless_configured() -> None:
    cfg = bind_front_door(AppConfig(), "127.0.0.2")
    assert cfg.http.host == "127.0.0.2"
    assert cfg.http.port not in (0, 8000)  # OS-chosen, not the field's default
    assert cfg.grpc.enabled and cfg.grpc.port not in (0, 9000)  # gRPC on by default
    explicit = AppConfig.from_dict({"http": {"port": 8123}, "grpc": {"enabled": True}})
    cfg = bind_front_door(explicit, "127.0.0.2")
    assert cfg.http.port == 8123 and cfg.grpc.port not in (0, 9000)
    running = ServeRecord(
        app_name="pdserve",
        model_name="m",
        http_host="127.0.0.2",
        http_port=40001,
        route_prefix="/",
        grpc_port=40002,
    )
    cfg = bind_front_door(AppConfig.from_dict({"grpc": {"enabled": True}}), "127.0.0.2", running)
    assert (cfg.http.port, cfg.grpc.port) == (40001, 40002)  # Serve's proxies keep their ports
    assert running.http_url == "http://127.0.0.2:40001"
    assert curl_example(running).startswith("curl -s http://127.0.0.2:40001/v1/chat/completions ")
    assert grpc_example(running) == (
        "python -m pdserve.deployments.grpc.client --target 127.0.0.2:40002 "
        "--application pdserve --max-tokens 32 'Hello!'"
    )
    assert grpc_example(running.model_copy(update={"grpc_port": None})) is None
    off = bind_front_door(AppConfig.from_dict({"grpc": {"enabled": False}}), "127.0.0.2")
    assert not off.grpc.enabled


def test_state_round_trips(tmp_path: Path) -> None:
    node = NodeRecord(
        name="head",
        role="head",
        pid=123,
        temp_dir="/tmp/x/head",
        log_file="/tmp/l",
        labels={},
        num_cpus=0,
        metrics_export_port=1,
    )
    state = ClusterState(
        node_ip="127.0.0.2",
        gcs_address="127.0.0.2:1",
        dashboard_url=None,
        root_dir="/tmp/x",
        auth_token_path=str(tmp_path / "auth_token"),
        nodes=[node],
    )
    assert load_state(tmp_path) is None
    save_state(tmp_path, state)
    assert load_state(tmp_path) == state
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.json"]


def test_stop_sessions_kills_whole_session_even_if_sigterm_is_ignored() -> None:
    # A leader with two children, one of which ignores SIGTERM (like a stuck worker).
    script = "trap '' TERM; sleep 60 & (trap '' TERM; sleep 60) & wait"
    leader = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    try:

        def whole_session() -> list[int] | None:
            members = session_members([leader.pid])
            return members if len(members) >= 3 else None

        members = wait_until(
            whole_session, timeout=10, interval=0.05, what="the leader and its two children"
        )
        assert leader.pid in members and len(members) >= 3
        started = time.monotonic()
        assert stop_sessions([leader.pid], grace_s=0.5) == []
        assert time.monotonic() - started < 5
        assert not any(is_running(pid) for pid in members)
        assert leader.poll() is not None  # reaped: no zombie left behind by its parent
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)


def test_console_script_entry_point_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    for command in ("up", "serve", "status", "down", "run"):
        assert command in out.stdout


def test_every_subcommand_has_a_handler() -> None:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(cli.COMMANDS)


def test_resolved_test_model_keeps_its_client_facing_name() -> None:
    lines: list[str] = []
    cfg = resolve_model(AppConfig.from_dict({"model": {"test_model": "tiny"}}), lines.append)
    assert cfg.model.path is not None and "pdserve-tiny-" in str(cfg.model.path)
    assert cfg.model.served_name(str(cfg.model.path)) == "pdserve-tiny"
    assert any("generated once" in line for line in lines)


def test_deploy_waits_until_the_ingress_answers_http() -> None:
    """``pdserve serve`` says ready once ``GET /v1/models`` gets the ingress's answer (200,
    or 401 with API keys): not on Serve's 404 for a route it has not learnt yet, nor on a
    refused connection; and it gives up with the last answer it got."""
    import http.server
    import threading

    answers = [404, 503, 401]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(answers.pop(0) if len(answers) > 1 else answers[0])
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        record = ServeRecord(
            app_name="a",
            model_name="m",
            http_host="127.0.0.1",
            http_port=server.server_port,
            route_prefix="/",
            grpc_port=None,
        )
        wait_for_http(record, timeout_s=10)
        assert answers == [401]
        answers[0] = 404
        with pytest.raises(TimeoutError, match="HTTP 404"):
            wait_for_http(record, timeout_s=0.5)
    finally:
        server.shutdown()
        server.server_close()
