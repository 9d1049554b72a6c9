"""AppConfig: YAML loading, strictness, cross-field rules, Ray placement derived from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.deployments.config import AppConfig


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "app.yaml"
    path.write_text(text)
    return path


def test_yaml_round_trip_keeps_every_value(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
name: demo
model: {test_model: tiny, dtype: float32}
prefill:
  min_replicas: 1
  max_replicas: 4
  initial_replicas: 2
  num_cpus: 2
  engine: {num_kv_blocks: 128, max_num_batched_tokens: 512}
decode:
  node_labels: {pdserve.io/pool: decode, zone: a}
  accelerator_type: H100
  num_gpus: 1
slo: {ttft_ms: 500, tpot_ms: 50}
transport: {kind: shm, timeout_s: 3}
policy: {local_prefill_max_tokens: 32}
admission: {on_slo_miss: shed}
observability: {tracing_exporter: console}
""",
    )
    cfg = AppConfig.from_yaml(path)
    assert cfg.prefill.max_replicas == 4 and cfg.prefill.start_replicas == 2
    assert cfg.prefill.engine.num_kv_blocks == 128
    assert cfg.slo.ttft_ms == 500 and cfg.transport.kind == "shm"
    assert cfg.prefill.label_selector("prefill") == {"pdserve.io/pool": "prefill"}
    assert cfg.decode.label_selector("decode") == {
        "pdserve.io/pool": "decode",
        "zone": "a",
        "ray.io/accelerator-type": "H100",
    }
    again = AppConfig.from_yaml(write(tmp_path, cfg.to_yaml()))
    assert again == cfg


def test_an_admission_key_under_policy_names_where_it_moved(tmp_path: Path) -> None:
    path = write(tmp_path, "policy:\n  on_slo_miss: queue\n  reject_within_ms: 50\n")
    with pytest.raises(ValueError) as err:
        AppConfig.from_yaml(path)
    message = str(err.value)
    assert "policy.on_slo_miss moved to admission.on_slo_miss" in message
    assert "policy.reject_within_ms moved to admission.reject_within_ms" in message
    moved = AppConfig.from_dict({"admission": {"on_slo_miss": "queue", "reject_within_ms": 50}})
    assert moved.admission.on_slo_miss == "queue" and moved.admission.reject_within_ms == 50


def test_half_the_decode_ongoing_cap_is_admitted_while_interactive_traffic_sheds() -> None:
    shed = AppConfig.from_dict({"decode": {"max_ongoing_requests": 10, "max_replicas": 2}})
    assert shed.admission.max_admitted(shed.decode.ongoing_limit) == 5
    assert shed.ingress_ongoing_limit == 10  # 2 replicas x 5 admitted
    decode = {"max_ongoing_requests": 10, "max_replicas": 2}
    queue = AppConfig.from_dict({"decode": decode, "admission": {"on_slo_miss": "queue"}})
    assert queue.ingress_ongoing_limit == 20  # queueing: the whole caps


def test_empty_yaml_gives_defaults(tmp_path: Path) -> None:
    cfg = AppConfig.from_yaml(write(tmp_path, ""))
    assert cfg == AppConfig()
    assert cfg.model.path is None and cfg.model.test_model == "small"
    assert cfg.grpc.enabled  # gRPC is served unless the config turns it off
    assert cfg.transport.host is None  # = each replica's Ray node address


def test_unknown_field_is_rejected_with_its_path(tmp_path: Path) -> None:
    path = write(tmp_path, "prefill:\n  max_replica: 3\n")
    with pytest.raises(ValueError) as err:
        AppConfig.from_yaml(path)
    message = str(err.value)
    assert "prefill.max_replica" in message
    assert "unknown field" in message
    assert str(path) in message


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"prefill": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas (3)"),
        ({"decode": {"initial_replicas": 5, "max_replicas": 2}}, "initial_replicas (5)"),
        ({"decode": {"min_replicas": 0}}, "decode.min_replicas"),
        ({"prefill": {"accelerator_type": "L4", "num_gpus": 0}}, "num_gpus"),
        ({"prefill": {"node_labels": {"ray.io/node-id": "x"}}}, "reserved"),
        ({"slo": {"ttft_ms": 0}}, "slo.ttft_ms"),
        ({"transport": {"kind": "carrier-pigeon"}}, "transport.kind"),
        ({"transport": {"host": "0.0.0.0"}}, "transport.host"),
        ({"transport": {"host": "[::]"}}, "transport.host"),
        ({"decode": {"tensor_parallel_size": 0}}, "decode.tensor_parallel_size"),
        (
            {"prefill": {"tensor_parallel_size": 2, "num_gpus": 0.5}},
            "num_gpus (0.5) with tensor_parallel_size 2: num_gpus is per rank",
        ),
        ({"decode": {"tensor_parallel_size": 4, "num_gpus": 2}}, "others would sit idle"),
    ],
)
def test_invalid_values_name_the_field(data: dict, needle: str) -> None:
    with pytest.raises(ValueError, match="invalid pdserve config") as err:
        AppConfig.from_dict(data)
    assert needle in str(err.value)


def test_every_field_has_a_description() -> None:
    def walk(model: type) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{model.__name__}.{name}")
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                missing += walk(ann)
        return missing

    assert walk(AppConfig) == []


def test_model_path_must_exist(tmp_path: Path) -> None:
    cfg = AppConfig.from_dict({"model": {"path": str(tmp_path / "missing")}})
    with pytest.raises(ValueError, match="model.path"):
        cfg.model.resolve_path()
    assert cfg.model.served_name("/models/llama-3-8b") == "llama-3-8b"


def test_generated_test_model_is_served_under_a_stable_name() -> None:
    cfg = AppConfig.from_dict({"model": {"test_model": "small"}})
    # The cache directory's name carries a content hash; clients see "pdserve-small".
    assert cfg.model.served_name("/cache/pdserve-small-56b7b1d61e02") == "pdserve-small"
    named = AppConfig.from_dict({"model": {"test_model": "tiny", "name": "my-model"}})
    assert named.model.served_name("/cache/pdserve-tiny-0") == "my-model"


def test_a_gpu_pool_asks_for_one_gpu_per_replica_unless_configured() -> None:
    from pdserve.deployments.app import actor_options

    cuda = AppConfig.from_dict({"model": {"device": "cuda"}})
    assert cuda.gpus_per_replica("prefill") == cuda.gpus_per_replica("decode") == 1.0
    assert cuda.pool_device("decode") == "cuda"
    # 'auto' on a GPU node type means CUDA too; on an unlabelled CPU pool it asks for none.
    auto = AppConfig.from_dict({"prefill": {"accelerator_type": "H200"}})
    assert auto.gpus_per_replica("prefill") == 1.0 and auto.pool_device("prefill") == "cuda"
    assert auto.gpus_per_replica("decode") == 0.0 and auto.pool_device("decode") == "auto"
    assert (
        actor_options(auto.prefill, "prefill", auto.gpus_per_replica("prefill"))["num_gpus"] == 1.0
    )
    # An explicit count wins (two GPUs per replica, or a CPU pool on a GPU machine).
    two = AppConfig.from_dict({"model": {"device": "cuda"}, "decode": {"num_gpus": 2}})
    assert two.gpus_per_replica("decode") == 2.0
    cpu = AppConfig.from_dict({"model": {"device": "auto"}, "decode": {"num_gpus": 0}})
    assert cpu.pool_device("decode") == "cpu"


def test_a_cuda_pool_without_a_gpu_fails_its_start_with_the_reason() -> None:
    from pdserve.deployments.engine_factory import require_device

    cfg = AppConfig.from_dict({"model": {"device": "cuda"}})
    with pytest.raises(RuntimeError, match="decode replica: the pool runs on CUDA .* sees no GPU"):
        require_device(cfg, "decode", cuda_available=False)
    assert require_device(cfg, "decode", cuda_available=True) == "cuda"
    # A CUDA model on a pool given no GPU (num_gpus: 0) fails the same way at its start.
    zero = AppConfig.from_dict({"model": {"device": "cuda"}, "decode": {"num_gpus": 0}})
    with pytest.raises(RuntimeError, match="0 GPU per replica"):
        require_device(zero, "decode", cuda_available=False)
    cpu = AppConfig.from_dict({"model": {"device": "cpu"}})
    assert require_device(cpu, "prefill", cuda_available=False) == "cpu"


def test_tensor_parallel_pools_count_resources_per_rank() -> None:
    from pdserve.deployments.engine_factory import engine_config

    cfg = AppConfig.from_dict(
        {
            "model": {"device": "cuda"},
            "prefill": {"tensor_parallel_size": 4, "num_cpus": 2},
            "decode": {"tensor_parallel_size": 2, "num_gpus": 1},
        }
    )
    assert cfg.gpus_per_rank("prefill") == 1.0 and cfg.gpus_per_replica("prefill") == 4.0
    assert cfg.gpus_per_rank("decode") == 1.0 and cfg.gpus_per_replica("decode") == 2.0
    assert cfg.prefill.num_cpus == 2.0  # per rank: the replica reserves 8 CPUs
    # A CPU pool may split over ranks too (gloo), and a fractional GPU is fine at TP=1.
    cpu = AppConfig.from_dict(
        {"model": {"device": "cpu"}, "decode": {"tensor_parallel_size": 2, "num_gpus": 0}}
    )
    assert cpu.gpus_per_replica("decode") == 0.0
    assert AppConfig.from_dict({"decode": {"num_gpus": 0.5}}).gpus_per_replica("decode") == 0.5
    # Each replica's engine gets its pool's TP size.
    tiny = AppConfig.from_dict(
        {
            "model": {"device": "cpu"},
            "prefill": {"tensor_parallel_size": 2},
            "decode": {"tensor_parallel_size": 4},
        }
    )
    assert engine_config(tiny, "prefill", "/models/m").tensor_parallel_size == 2
    assert engine_config(tiny, "decode", "/models/m").tensor_parallel_size == 4
    assert engine_config(AppConfig(), "decode", "/models/m").tensor_parallel_size == 1


def test_a_tensor_parallel_cuda_pool_without_a_gpu_names_its_ranks() -> None:
    from pdserve.deployments.engine_factory import require_device

    cfg = AppConfig.from_dict({"model": {"device": "cuda"}, "decode": {"tensor_parallel_size": 2}})
    with pytest.raises(RuntimeError, match="1 GPU per rank, 2 ranks per replica"):
        require_device(cfg, "decode", cuda_available=False)


def test_prefill_and_decode_pools_of_different_kv_dtypes_are_refused_naming_both() -> None:
    from pdserve.deployments.engine_factory import engine_config

    pools = {"prefill": {"engine": {"kv_cache_dtype": "int8"}}}
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8'.*kv_cache_dtype='auto'"):
        AppConfig.model_validate({**pools, "decode": {"engine": {"kv_cache_dtype": "auto"}}})
    both = {**pools, "decode": {"engine": {"kv_cache_dtype": "int8"}}}
    cfg = AppConfig.model_validate(both)
    assert engine_config(cfg, "decode", "/models/m").kv_cache_dtype == "int8"
    # A decode pool that always prefills itself hands nothing off: any dtype.
    local = {**pools, "policy": {"mode": "always_local"}}
    assert AppConfig.model_validate(local).decode.engine.kv_cache_dtype == "auto"
    # Tensor-parallel pools of one KV dtype pair, whatever their sizes (each rank moves its
    # heads' quantized blocks, with their scales).
    tp = {"engine": {"kv_cache_dtype": "int8"}, "tensor_parallel_size": 2}
    cfg = AppConfig.model_validate({"prefill": tp, "decode": {**tp, "tensor_parallel_size": 1}})
    assert engine_config(cfg, "prefill", "/models/m").tensor_parallel_size == 2
