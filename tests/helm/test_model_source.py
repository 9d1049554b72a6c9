"""Model sources: a Hub id or an object-store URI is fetched into the node's cache before any
replica loads (the chart's init container runs ``pdserve.deployments.model_source``), and a
missing model fails with a message that names its source.

The Hub is a local fake (``fake_hub.py``: why a server and not an offline cache is said
there); the object store is fsspec's local and in-memory filesystems, which take the same
code path as s3:// or gs:// once their backend is installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.deployments.config import AppConfig, ModelSettings
from pdserve.deployments.model_source import (
    MARKER,
    ModelSourceError,
    cache_path,
    fetch,
    resolve,
)
from tests.helm.fake_hub import FakeRepo, serve_fake_hub

REPO = "pdserve-test/tiny-llama"


@pytest.fixture(scope="module")
def tiny_model_files() -> dict[str, bytes]:
    """The files of a real (generated) model directory, plus what a Hub repo also carries
    and a replica must not download."""
    from pdserve.engine.testmodel import ensure_test_model

    directory = ensure_test_model("tiny")
    files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    assert "model.safetensors" in files and "config.json" in files
    files["original/consolidated.00.pth"] = b"a second copy of the weights"
    files["pytorch_model.bin"] = b"pickled weights"
    files["README.md"] = b"# tiny"
    return files


def hub_model(tmp_path: Path, repo: str = REPO, **extra: object) -> ModelSettings:
    return ModelSettings(hf_id=repo, cache_dir=str(tmp_path / "cache"), **extra)


def downloads(hub) -> list[str]:
    return [path for method, path, _ in hub.requests if method == "GET" and "/resolve/" in path]


def test_hub_model_is_fetched_once_and_the_engine_loads_it(
    tmp_path: Path, tiny_model_files: dict[str, bytes]
) -> None:
    from pdserve.engine.loader import load_model_config, load_tokenizer, safetensors_files

    model = hub_model(tmp_path)
    with pytest.raises(ModelSourceError, match=f"model.hf_id '{REPO}'.*not in the model cache"):
        model.resolve_path()  # the app builder's call: it never downloads
    with serve_fake_hub({REPO: FakeRepo(tiny_model_files)}) as hub:
        directory = fetch(model, endpoint=hub.url)
        first = downloads(hub)
        assert fetch(model, endpoint=hub.url) == directory  # a second pod on the node
        assert downloads(hub) == first  # ...downloads nothing
    assert directory == cache_path(model)
    assert model.resolve_path() == str(directory)
    fetched = {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}
    fetched = {p for p in fetched if not p.startswith(".cache/")}  # huggingface_hub's own
    wanted = {n for n in tiny_model_files if n.endswith((".json", ".safetensors"))}
    assert fetched == wanted | {MARKER}  # no .bin, no original/, no README
    for name in wanted:
        assert (directory / name).read_bytes() == tiny_model_files[name]
    # What a replica and the ingress read, from the fetched directory.
    assert load_model_config(directory).vocab_size > 0
    assert [p.name for p in safetensors_files(directory)] == ["model.safetensors"]
    assert load_tokenizer(directory).encode("hello") != []
    assert model.served_name(str(directory)) == REPO


def test_metadata_only_fetch_then_full_fetch(
    tmp_path: Path, tiny_model_files: dict[str, bytes]
) -> None:
    model = hub_model(tmp_path)
    with serve_fake_hub({REPO: FakeRepo(tiny_model_files)}) as hub:
        directory = fetch(model, metadata_only=True, endpoint=hub.url)
        assert not list(directory.glob("*.safetensors"))  # the head: no weights
        assert (directory / "tokenizer.json").is_file()
        assert resolve(model) == directory  # enough for the app builder
        # A worker pod on the same node still gets the weights.
        fetch(model, endpoint=hub.url)
        assert (directory / "model.safetensors").read_bytes() == tiny_model_files[
            "model.safetensors"
        ]
        assert json.loads((directory / MARKER).read_text())["weights"] is True


def test_private_repo_needs_the_token(
    tmp_path: Path, tiny_model_files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = hub_model(tmp_path, revision="main")
    with serve_fake_hub({REPO: FakeRepo(tiny_model_files, token="hf_secret")}) as hub:
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored login
        with pytest.raises(ModelSourceError) as err:
            fetch(model, endpoint=hub.url)
        assert f"model.hf_id '{REPO}' (revision 'main')" in str(err.value)
        assert "modelStorage.hfTokenSecret" in str(err.value)
        assert not (cache_path(model) / MARKER).exists()
        monkeypatch.setenv("HF_TOKEN", "hf_secret")  # what the chart sets from the Secret
        directory = fetch(model, endpoint=hub.url)
        assert (directory / "model.safetensors").is_file()
        assert {auth for _, _, auth in hub.requests} >= {None, "Bearer hf_secret"}


def test_missing_repo_and_repo_without_safetensors_name_the_source(
    tmp_path: Path, tiny_model_files: dict[str, bytes]
) -> None:
    no_safetensors = {k: v for k, v in tiny_model_files.items() if k != "model.safetensors"}
    with serve_fake_hub({"org/bin-only": FakeRepo(no_safetensors)}) as hub:
        with pytest.raises(ModelSourceError, match="'org/missing'.*not found on the Hub"):
            fetch(hub_model(tmp_path, "org/missing"), endpoint=hub.url)
        with pytest.raises(ModelSourceError, match="'org/bin-only'.*no \\*.safetensors"):
            fetch(hub_model(tmp_path, "org/bin-only"), endpoint=hub.url)


def test_the_charts_init_container_command_fetches_the_model(
    tmp_path: Path, tiny_model_files: dict[str, bytes]
) -> None:
    """Run the command the chart renders for a worker pod, as its own process."""
    from tests.helm.rendering import VALUE_SETS, pod_specs, rayservice

    values = {"app": {"model": {"hf_id": REPO}}}
    assert VALUE_SETS["defaults"] is None  # the default install fetches from the Hub too
    pod = pod_specs(rayservice(values))["decode"]
    (init,) = pod["initContainers"]
    command = list(init["command"])
    assert command[:3] == ["python", "-m", "pdserve.deployments.model_source"]
    at = command.index("--model") + 1
    model = yaml.safe_load(command[at])
    model["cache_dir"] = str(tmp_path / "cache")  # the pod's cache volume, here
    command[at] = json.dumps(model)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.update({e["name"]: e["value"] for e in init["env"] if "value" in e})
    with serve_fake_hub({REPO: FakeRepo(tiny_model_files)}) as hub:
        env["HF_ENDPOINT"] = hub.url
        done = subprocess.run(
            [sys.executable, *command[1:]], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        directory = Path(done.stdout.strip())
        assert (directory / "model.safetensors").is_file()
        # The app builder on the head resolves the same directory from the app args.
        assert ModelSettings.model_validate(model).resolve_path() == str(directory)
        command[at] = json.dumps({**model, "hf_id": "org/missing"})
        failed = subprocess.run(
            [sys.executable, *command[1:]], env=env, capture_output=True, text=True, timeout=120
        )
    assert failed.returncode == 1
    assert "model.hf_id 'org/missing'" in failed.stderr and "not found" in failed.stderr


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_object_store_uri_is_fetched_through_fsspec(
    tmp_path: Path, tiny_model_files: dict[str, bytes], scheme: str
) -> None:
    import fsspec

    if scheme == "file":
        uri = f"file://{tmp_path}/bucket/models/tiny"
    else:
        uri = f"memory://bucket-{tmp_path.name}/models/tiny"
    fs, root = fsspec.core.url_to_fs(uri)
    for name, data in tiny_model_files.items():
        fs.makedirs(f"{root}/{name}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{root}/{name}", data)
    model = ModelSettings(uri=uri, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ModelSourceError, match=f"model.uri '{uri}'"):
        resolve(model)
    directory = fetch(model)
    assert directory == cache_path(model) and str(directory).startswith(str(tmp_path / "cache"))
    assert (directory / "model.safetensors").read_bytes() == tiny_model_files["model.safetensors"]
    assert not (directory / "pytorch_model.bin").exists()
    assert not (directory / "original").exists()
    assert model.resolve_path() == str(directory)
    assert model.served_name(str(directory)) == "tiny"
    missing = ModelSettings(uri=uri + "-missing", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ModelSourceError, match="-missing'.*no such directory"):
        fetch(missing)


def test_object_store_without_its_backend_says_what_to_install(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    try:
        import s3fs  # noqa: F401

        pytest.skip("s3fs is installed here")
    except ImportError:
        pass
    model = ModelSettings(uri="s3://bucket/llama", cache_dir=str(tmp_path))
    with pytest.raises(ModelSourceError, match="model.uri 's3://bucket/llama'.*s3fs"):
        fetch(model)


def test_model_settings_take_one_source() -> None:
    for bad, message in [
        ({"hf_id": "a/b", "uri": "s3://x/y"}, "one source, hf_id or uri"),
        ({"path": "/models/x", "hf_id": "a/b"}, "one source, path or hf_id/uri"),
        ({"revision": "main"}, "revision applies to hf_id only"),
        ({"hf_id": "not a repo id"}, "model.hf_id"),
        ({"uri": "bucket/no-scheme"}, "model.uri"),
    ]:
        with pytest.raises(ValueError, match=message):
            AppConfig.from_dict({"model": bad})
    # A launcher may pin a fetched hub model's directory as path (replicas re-validate it).
    hub = ModelSettings(hf_id="a/b")
    pinned = ModelSettings(hf_id="a/b", path=str(cache_path(hub)))  # accepted
    with pytest.raises(ModelSourceError, match="model.path .* is not a directory"):
        pinned.resolve_path()
    with pytest.raises(ValueError, match="model.path '/nowhere' is not a directory"):
        ModelSettings(path="/nowhere").resolve_path()


def test_config_and_model_source_import_without_torch_or_ray(tmp_path: Path) -> None:
    """The init container and the Helm tests validate configs and resolve model sources
    with neither torch nor Ray importable."""
    code = (
        "import sys\n"
        "for name in ('torch', 'ray'): sys.modules[name] = None\n"
        "from pdserve.deployments.config import AppConfig\n"
        "from pdserve.deployments.model_source import ModelSourceError, main\n"
        "cfg = AppConfig.from_dict({'model': {'hf_id': 'a/b', 'cache_dir': sys.argv[1]}})\n"
        "try:\n"
        "    cfg.model.resolve_path()\n"
        "except ModelSourceError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "model.hf_id 'a/b'" in done.stdout and "not in the model cache" in done.stdout


def test_the_head_builds_the_serve_app_from_the_charts_config_after_its_fetch(
    tmp_path: Path, tiny_model_files: dict[str, bytes]
) -> None:
    """What happens on the head pod: its init container fetches config and tokenizer, then
    Serve imports pdserve.deployments.app:build_app with the rendered serveConfigV2's args."""
    from ray.serve._private.build_app import build_app as serve_build_app
    from ray.serve.schema import ServeDeploySchema

    from pdserve.deployments.app import build_app
    from tests.helm.rendering import groups, rayservice

    svc = rayservice({"app": {"model": {"hf_id": REPO}}})
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(svc["spec"]["serveConfigV2"]))
    args = dict(serve_config.applications[0].args)
    args["model"] = {**args["model"], "cache_dir": str(tmp_path / "cache")}  # the cache volume
    with pytest.raises(ModelSourceError, match=f"model.hf_id '{REPO}'"):
        build_app(args)  # before the init container ran
    with serve_fake_hub({REPO: FakeRepo(tiny_model_files)}) as hub:
        fetch(ModelSettings.model_validate(args["model"]), metadata_only=True, endpoint=hub.url)
    deployments = {d.name: d for d in serve_build_app(build_app(args), name="pdserve").deployments}
    assert set(deployments) == {"OpenAIIngress", "PrefillServer", "DecodeServer"}
    group_labels = {name: g["labels"] for name, g in groups(svc).items()}
    for role, name in (("prefill", "PrefillServer"), ("decode", "DecodeServer")):
        deployment = deployments[name]
        assert deployment.ray_actor_options["label_selector"] == group_labels[role]
        assert deployment._deployment_config.graceful_shutdown_timeout_s == 300  # drain
        assert str(cache_path(ModelSettings.model_validate(args["model"]))) in map(
            str, deployment.init_args
        )
    ingress = deployments["OpenAIIngress"]
    assert ingress._deployment_config.graceful_shutdown_timeout_s == 300
