"""The app configs shipped in configs/ load with AppConfig and say what their comments say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pdserve.cluster.cli import _cluster_spec, build_parser
from pdserve.deployments.config import AppConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))


def test_the_two_core_configs_are_shipped() -> None:
    names = {p.name for p in SHIPPED}
    assert {"local-2core-disagg.yaml", "local-2core-colocated.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path) -> None:
    cfg = AppConfig.from_yaml(path)
    # A round trip through YAML gives the same config: nothing in the file is dropped.
    assert AppConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg


def documented_up_args(path: Path) -> list[str]:
    """The `pdserve up ...` flags a config's header comment tells the user to start with."""
    match = re.search(r"^#\s+pdserve up(.*)$", path.read_text(), re.MULTILINE)
    assert match, f"{path.name}: the header should say how to start the cluster"
    return match.group(1).split("#")[0].split()


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_replicas_fit_on_the_cluster_the_config_documents(path: Path) -> None:
    cfg = AppConfig.from_yaml(path)
    args = build_parser().parse_args(["up", *documented_up_args(path)])
    nodes = {n.role: n for n in _cluster_spec(args).nodes()}
    roles = ["decode"] if cfg.policy.mode == "always_local" else ["prefill", "decode"]
    for role in roles:
        pool = cfg.pool(role)
        asked = pool.start_replicas * pool.num_cpus
        assert asked <= nodes[role].num_cpus, f"{path.name}: {role} asks {asked} CPUs"
    if "2core" in path.name:
        assert cfg.model.device == "cpu"
        assert max(cfg.prefill.num_cpus, cfg.decode.num_cpus) <= 2


def test_compare_serving_starts_the_clusters_the_configs_document() -> None:
    from pdserve.bench.compare_serving import parse_args

    args = parse_args([])
    assert args.disagg_config.name == "local-2core-disagg.yaml"
    assert args.disagg_up_args.split() == documented_up_args(args.disagg_config)
    assert args.coloc_up_args.split() == documented_up_args(args.coloc_config)


def test_colocated_config_has_no_prefill_pool() -> None:
    cfg = AppConfig.from_yaml(CONFIG_DIR / "local-2core-colocated.yaml")
    assert cfg.policy.mode == "always_local"
    # One engine thread: the second core is left to the Ray proxy and the ingress.
    assert cfg.decode.num_cpus == 1 and cfg.prefill.min_replicas == 0


def test_disaggregated_config_sends_long_prompts_to_the_prefill_pool() -> None:
    from pdserve.deployments.policy import DisaggregationPolicy, LocalLoad, RemotePrefillEstimator

    cfg = AppConfig.from_yaml(CONFIG_DIR / "local-2core-disagg.yaml")
    assert cfg.prefill.min_replicas >= 1 and cfg.policy.mode == "auto"
    assert cfg.prefill.cpu.nice > cfg.decode.cpu.nice  # decode steps win shared cores
    policy = DisaggregationPolicy(cfg.policy, cfg.slo, cfg.router.default_prefill_tokens_per_s)
    load = LocalLoad(
        queued_prefill_tokens=0,
        prefill_tokens_per_s=0.0,
        num_running=4,
        max_num_seqs=cfg.decode.engine.max_num_seqs,
    )
    remote = RemotePrefillEstimator(cfg.router.default_prefill_tokens_per_s)

    def where(tokens: int) -> str:
        return policy.decide(
            num_prompt_tokens=tokens, num_cached_tokens=0, load=load, remote=remote
        ).location

    # Every fresh prompt goes to the prefill node; a cached prefix is finished locally
    # (placement only: the decode server leaves shedding to admission control).
    assert where(128) == "remote"
    assert where(1536) == "remote"
    local = policy.decide(num_prompt_tokens=1536, num_cached_tokens=1530, load=load, remote=remote)
    assert local.location == "local"
