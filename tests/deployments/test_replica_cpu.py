"""A pool's ``cpu:`` section: validated in the config, and handed to the engine's device
runtime with the replica's num_cpus and the node's $PDSERVE_ENGINE_CPUS (what the runtime
does with them is tested in tests/kernels/test_cpu_runtime.py)."""

from __future__ import annotations

import pytest

from pdserve.deployments.config import AppConfig
from pdserve.deployments.engine_factory import pool_hooks, runtime_settings
from pdserve.kernels.cpu.cpus import RuntimeSettings


def test_nice_is_validated() -> None:
    with pytest.raises(ValueError, match="nice"):
        AppConfig.from_dict({"prefill": {"cpu": {"nice": 20}}})
    assert AppConfig.from_dict({"prefill": {"cpu": {"nice": 10}}}).prefill.cpu.nice == 10


def test_cpu_bind_is_validated() -> None:
    for bad in ("2-1", "one", ""):
        with pytest.raises(ValueError, match="cpu_bind"):
            AppConfig.from_dict({"decode": {"cpu": {"cpu_bind": bad}}})
    cfg = AppConfig.from_dict({"decode": {"cpu": {"cpu_bind": "0-1"}}})
    assert cfg.decode.cpu.cpu_bind == "0-1" and cfg.prefill.cpu.cpu_bind == "auto"


def test_helper_threads_are_validated() -> None:
    cfg = AppConfig.from_dict({"decode": {"cpu": {"helper_threads": 1, "helper_min_tokens": 64}}})
    assert (cfg.decode.cpu.helper_threads, cfg.decode.cpu.helper_min_tokens) == (1, 64)
    assert cfg.prefill.cpu.helper_threads == 0
    for bad in ({"helper_threads": -1}, {"helper_min_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AppConfig.from_dict({"decode": {"cpu": bad}})


def test_the_old_flat_cpu_fields_are_refused() -> None:
    for old in ({"nice": 1}, {"cpu_bind": "0"}, {"helper_threads": 1}):
        with pytest.raises(ValueError, match=next(iter(old))):
            AppConfig.from_dict({"decode": old})


def test_a_pool_hands_its_cpu_section_and_the_node_reservation_to_the_runtime() -> None:
    cfg = AppConfig.from_dict(
        {
            "decode": {
                "num_cpus": 2,
                "cpu": {"nice": 3, "helper_threads": 1, "helper_min_tokens": 64},
            }
        }
    )
    env = {"PDSERVE_ENGINE_CPUS": "0"}
    assert runtime_settings(cfg.decode, env) == RuntimeSettings(
        num_cpus=2,
        nice=3,
        cpu_bind="auto",
        node_engine_cpus="0",
        helper_threads=1,
        helper_min_tokens=64,
    )
    assert runtime_settings(cfg.decode, env).engine_cpus() == (0,)
    assert runtime_settings(cfg.prefill, {}).engine_cpus() == ()  # nothing reserved: unbound
    hooks = pool_hooks(cfg, "prefill", kv_connector=None)
    assert hooks.role == "prefill" and hooks.runtime is not None
    assert hooks.runtime.num_cpus == cfg.prefill.num_cpus
