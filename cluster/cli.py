"""pdserve: prefill/decode disaggregated LLM serving on Ray Serve (the `pdserve` command).

  pdserve up                 start a local head + prefill node + decode node on 127.0.0.2
  pdserve serve [CONFIG]     deploy the app (AppConfig YAML; default: the small test model)
  pdserve status             nodes, pools, replicas and load
  pdserve env                `export` lines that point ray/serve CLIs at the cluster
  pdserve down               stop everything `up` started, by pid; remove its temp dirs
  pdserve run [CONFIG]       up + serve, wait for Ctrl-C / SIGTERM, then down
  pdserve plan               prefill/decode replica counts for a rate and SLOs (simulated)

What `up` started is recorded in a state directory: --state-dir, else $PDSERVE_STATE_DIR,
else $XDG_STATE_HOME/pdserve (~/.local/state/pdserve). Both are read here, once.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from pdserve.cluster.state import ClusterState, default_state_dir, load_state, ray_client_env

STATE_DIR_ENV = "PDSERVE_STATE_DIR"
API_KEYS_ENV = "PDSERVE_API_KEYS"
EXIT_FAILURE, EXIT_USAGE = 1, 2


def _say(message: str) -> None:
    print(f"pdserve: {message}", flush=True)


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"where the cluster's state file lives (default: ${STATE_DIR_ENV} or "
        f"{default_state_dir()})",
    )
    cluster_flags = argparse.ArgumentParser(add_help=False)
    group = cluster_flags.add_argument_group("cluster")
    group.add_argument("--head-cpus", type=int, default=None, help="logical CPUs of the head (0)")
    group.add_argument(
        "--prefill-cpus", type=int, default=None, help="CPUs of the prefill node (half the cores)"
    )
    group.add_argument(
        "--decode-cpus", type=int, default=None, help="CPUs of the decode node (the other half)"
    )
    group.add_argument(
        "--prefill-gpus", type=int, default=None, help="GPUs of the prefill node (0)"
    )
    group.add_argument("--decode-gpus", type=int, default=None, help="GPUs of the decode node (0)")
    group.add_argument(
        "--object-store-mib", type=int, default=None, help="object store cap per node (256)"
    )
    group.add_argument(
        "--no-dashboard", action="store_true", help="skip the dashboard (status needs it)"
    )
    group.add_argument(
        "--no-pin-cpus",
        action="store_true",
        help="let every process run on every CPU (default: engine CPUs of their own)",
    )
    group.add_argument(
        "--direct-ingress",
        action="store_true",
        help="the ingress replica serves HTTP/gRPC itself (Serve's direct ingress, no proxy)",
    )
    group.add_argument(
        "--start-timeout", type=_positive_float, default=90.0, help="seconds per node to start"
    )
    serve_flags = argparse.ArgumentParser(add_help=False)
    serve_flags.add_argument(
        "config", nargs="?", type=Path, default=None, help="AppConfig YAML (default: built-in)"
    )
    serve_flags.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=(
            f"require this API key (repeatable; also ${API_KEYS_ENV}, comma-separated, and "
            "the config's api.api_keys)"
        ),
    )
    serve_flags.add_argument(
        "--deploy-timeout",
        type=_positive_float,
        default=600.0,
        help="seconds to wait for every replica to run",
    )

    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("up", parents=[common, cluster_flags], help="start the local cluster")
    sub.add_parser("serve", parents=[common, serve_flags], help="deploy the application")
    status = sub.add_parser("status", parents=[common], help="show nodes, pools, replicas")
    status.add_argument("--json", action="store_true", help="print the recorded state as JSON")
    sub.add_parser(
        "env", parents=[common], help="print `export` lines for ray/serve CLIs and drivers"
    )
    sub.add_parser("down", parents=[common], help="stop the local cluster")
    sub.add_parser(
        "run", parents=[common, cluster_flags, serve_flags], help="up + serve, wait, down"
    )
    _add_plan_parser(sub)
    return parser


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="recommend prefill and decode replica counts (simulated with pdserve's own router)",
        description=(
            "Simulate candidate clusters (pdserve.sim, roofline GPU model) on a Poisson "
            "workload and recommend the fewest GPUs whose SLO attainment meets --target, "
            "disaggregated (P:D) and colocated."
        ),
    )
    plan.add_argument("--model", required=True, help="llama-3-8b or llama-3-70b")
    plan.add_argument("--gpu", required=True, help="h100, h200, a100 or l4")
    plan.add_argument("--rate", type=_positive_float, required=True, help="requests per second")
    plan.add_argument("--ttft-ms", type=_positive_float, required=True, help="TTFT SLO")
    plan.add_argument("--tpot-ms", type=_positive_float, required=True, help="TPOT SLO")
    plan.add_argument(
        "--prompt", default="chat", help="chat|summarisation|code, N, or lognormal:MEDIAN:SIGMA"
    )
    plan.add_argument("--output", default="chat", help="same forms as --prompt")
    plan.add_argument("--tp", type=int, default=0, help="GPUs per replica (0 = smallest fit)")
    plan.add_argument("--link", default="nvlink", help="KV link: nvlink, infiniband, ethernet")
    plan.add_argument("--target", type=float, default=0.9, help="attainment to meet (0.9)")
    plan.add_argument("--requests", type=int, default=1200, help="simulated requests per run")
    plan.add_argument("--seed", type=int, default=0)
    plan.set_defaults(state_dir=None)  # plans need no cluster


def resolve_state_dir(flag: Path | None) -> Path:
    if flag is not None:
        return flag
    env = os.environ.get(STATE_DIR_ENV)
    return Path(env) if env else default_state_dir()


def _cluster_spec(args: argparse.Namespace):  # -> ClusterSpec (import kept lazy)
    from pdserve.cluster.topology import ClusterSpec

    return ClusterSpec.for_this_machine(
        head_cpus=args.head_cpus,
        prefill_cpus=args.prefill_cpus,
        decode_cpus=args.decode_cpus,
        prefill_gpus=args.prefill_gpus,
        decode_gpus=args.decode_gpus,
        object_store_mib=args.object_store_mib,
        dashboard=False if args.no_dashboard else None,
        pin_cpus=False if args.no_pin_cpus else None,
        direct_ingress=True if args.direct_ingress else None,
    )


def _load_config(path: Path | None, api_keys: list[str] | None = None):  # -> AppConfig
    """The config file (or the defaults) with the keys from --api-key and $PDSERVE_API_KEYS
    added to ``api.api_keys``: the environment is read here, at the edge, once."""
    from pdserve.deployments.config import AppConfig

    if path is None:
        config = AppConfig()
    elif not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    else:
        config = AppConfig.from_yaml(path)
    env_keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    extra = [k for k in [*(api_keys or []), *env_keys] if k not in config.api.api_keys]
    if not extra:
        return config
    data = config.model_dump(mode="json")
    data["api"]["api_keys"] = [*config.api.api_keys, *extra]
    return AppConfig.from_dict(data)


def cmd_up(args: argparse.Namespace, state_dir: Path) -> int:
    from pdserve.cluster.local import start_cluster

    state = start_cluster(
        _cluster_spec(args), state_dir, timeout_s=args.start_timeout, progress=_say
    )
    _say(f"head at {state.gcs_address}; dashboard {state.dashboard_url or 'off'}")
    _say(f"state in {state_dir}; next: `pdserve serve` (or `pdserve down`)")
    return 0


def _join(state_dir: Path) -> ClusterState:
    """The recorded cluster, with this process's Ray client settings pointed at it."""
    state = load_state(state_dir)
    if state is None:
        raise RuntimeError(f"no cluster recorded in {state_dir}; run `pdserve up` first")
    os.environ.update(ray_client_env(state))  # before Ray is imported: it reads them once
    return state


def cmd_serve(args: argparse.Namespace, state_dir: Path, config=None) -> int:
    from pdserve.cluster.serving import curl_example, deploy, grpc_example
    from pdserve.cluster.state import save_state

    state = _join(state_dir)
    config = config if config is not None else _load_config(args.config, args.api_key)
    record = deploy(state, config, timeout_s=args.deploy_timeout, progress=_say)
    save_state(state_dir, state.model_copy(update={"serve": record}))
    print(f"\npdserve is ready: model {record.model_name!r}", flush=True)
    print(f"  OpenAI API  {record.http_url}/v1", flush=True)
    if record.grpc_address:
        print(f"  gRPC        {record.grpc_address}", flush=True)
    if state.dashboard_url:
        print(f"  dashboard   {state.dashboard_url}", flush=True)
    print(f"  try:\n    {curl_example(record)}", flush=True)
    if (grpc_call := grpc_example(record)) is not None:
        print(f"    {grpc_call}", flush=True)
    print(flush=True)
    return 0


def cmd_status(args: argparse.Namespace, state_dir: Path) -> int:
    state = _join(state_dir)
    if args.json:
        print(state.model_dump_json(indent=2))
        return 0
    from pdserve.cluster.status import collect_status, format_status

    status = collect_status(state)
    print(format_status(status), flush=True)
    healthy = all(n.process_running and n.ray_state == "ALIVE" for n in status.nodes)
    return 0 if healthy else EXIT_FAILURE


def cmd_env(args: argparse.Namespace, state_dir: Path) -> int:
    state = _join(state_dir)
    for key, value in ray_client_env(state).items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


def cmd_down(args: argparse.Namespace, state_dir: Path) -> int:
    from pdserve.cluster.local import stop_cluster

    report = stop_cluster(state_dir)
    if not report.stopped:
        _say(f"no cluster recorded in {state_dir}; nothing to stop")
        return 0
    if report.survivors:
        _say(f"processes still running after SIGKILL: {report.survivors}")
        return EXIT_FAILURE
    _say(f"stopped {', '.join(report.stopped)}; temp dirs removed")
    return 0


class _Stop(Exception):
    """Raised in the main thread by the first SIGINT/SIGTERM so `run` unwinds into its clean-up."""


class _StopOnSignal:
    """SIGINT/SIGTERM handler of `run`: the first signal raises `_Stop`, every later one is
    ignored.

    The handler disarms itself (records the signal, then ignores both signals at the OS
    level) before it raises, so a second signal, which arrives whenever a process group is
    signalled and ``make`` forwards the same signal to its child, can never interrupt the
    clean-up the first one started, nor kill the process while it exits (Python resets its
    own handlers to the default action at interpreter shutdown; SIG_IGN it keeps).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous = {sig: signal.getsignal(sig) for sig in self.SIGNALS}

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is not None:  # a second signal that re-entered the handler
            return
        self.received = signal.Signals(signum).name
        self._ignore()
        raise _Stop(self.received)

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self)

    def _ignore(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def disarm(self) -> None:
        """Ignore both signals from now on (and so replace any handler Ray installed)."""
        if self.received is None:
            self.received = "stop"
        self._ignore()

    def restore(self) -> None:
        """The handlers from before `install`; only when `run` ends for a reason other than
        a signal (then the process is on its way out and must not die mid-exit)."""
        for sig, handler in self._previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def cmd_run(args: argparse.Namespace, state_dir: Path) -> int:
    from pdserve.cluster.local import running_nodes, stop_cluster
    from pdserve.cluster.procs import child_session_leaders, stop_sessions
    from pdserve.cluster.serving import prepare_model_in_background

    # Fail on a bad config before starting anything.
    config = _load_config(args.config, args.api_key)
    stop = _StopOnSignal()
    stop.install()
    try:
        model_ready = prepare_model_in_background(config)  # overlaps with the nodes' start
        cmd_up(args, state_dir)
        model_ready.join()
        cmd_serve(args, state_dir, config)
        _disconnect()  # the app outlives the driver; waiting needs no Ray connection
        stop.install()  # Ray's driver installs handlers of its own
        _say("serving; Ctrl-C or SIGTERM stops the cluster")
        idle = threading.Event()
        while True:  # until a signal; also ends when a node dies under us
            idle.wait(2.0)
            state = load_state(state_dir)
            if state is None or len(running_nodes(state)) < len(state.nodes):
                _say("a node of the cluster exited; shutting down")
                return EXIT_FAILURE
    except _Stop as why:
        _say(f"stopping ({why})")
        return 0
    except SystemExit as why:
        # ray.init's own SIGTERM handler (sys.exit(signum)) was in place while connecting.
        if why.code != signal.SIGTERM:
            raise
        stop.received = "SIGTERM"
        _say("stopping (SIGTERM)")
        return 0
    finally:
        stop.disarm()
        _disconnect()
        report = stop_cluster(state_dir)
        if report.stopped:
            _say(f"stopped {', '.join(report.stopped)}")
        # A node whose `ray start` was forked just before the signal may not be recorded
        # yet; it is still a child of this process, leading a session of its own.
        survivors = report.survivors + stop_sessions(child_session_leaders())
        if survivors:
            _say(f"processes still running after SIGKILL: {survivors}")
        if stop.received == "stop":  # not ended by a signal: the caller's handlers again
            stop.restore()


def _disconnect() -> None:
    """Leave the cluster before it goes away, so the driver does not log lost connections."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def cmd_plan(args: argparse.Namespace, state_dir: Path) -> int:
    # Imported here: the simulator pulls in the routers (Ray's router API) and numpy,
    # which the rest of the CLI must not need.
    from pdserve.sim.plan import PlanRequest, format_plan, plan

    if not 0 < args.target <= 1:
        raise ValueError(f"--target must be in (0, 1], got {args.target}")
    if args.requests < 10:
        raise ValueError(f"--requests must be >= 10, got {args.requests}")
    request = PlanRequest(
        model=args.model,
        gpu=args.gpu,
        rate=args.rate,
        ttft_ms=args.ttft_ms,
        tpot_ms=args.tpot_ms,
        prompt=args.prompt,
        output=args.output,
        tp=args.tp,
        link=args.link,
        target=args.target,
        num_requests=args.requests,
        seed=args.seed,
    )
    print(format_plan(request, plan(request)), flush=True)
    return 0


COMMANDS = {
    "up": cmd_up,
    "serve": cmd_serve,
    "status": cmd_status,
    "env": cmd_env,
    "down": cmd_down,
    "run": cmd_run,
    "plan": cmd_plan,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    state_dir = resolve_state_dir(args.state_dir)
    try:
        return COMMANDS[args.command](args, state_dir)
    except ValueError as err:  # bad config or flag values
        print(f"pdserve {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except (RuntimeError, TimeoutError, OSError) as err:
        print(f"pdserve {args.command}: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"pdserve {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
