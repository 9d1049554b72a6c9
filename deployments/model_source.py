"""Where a model directory comes from, and the one step that downloads it.

``ModelSettings`` names one source: ``path`` (a local directory, e.g. a mounted PVC),
``hf_id`` (a Hugging Face Hub repository) or ``uri`` (an object-store prefix such as
``s3://bucket/llama``, read through fsspec). Hub and object-store models are fetched into
``cache_dir`` by ``fetch``, which runs *before* any replica loads: the Helm chart runs it as
an init container on every Ray pod (``python -m pdserve.deployments.model_source fetch``),
so the download happens once per node (the cache is a hostPath volume) and the engine only
ever reads a local directory. ``resolve`` never downloads: it returns the local directory
or raises ``ModelSourceError`` naming the source and what to do.

Must never import torch or Ray: it runs in init containers and from the config module.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import json
import os
import posixpath
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.deployments.config import ModelSettings

# What a replica reads: config, safetensors weights, tokenizer and chat-template files.
WANTED_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
# Meta's repositories carry a second, consolidated copy of the weights under original/.
SKIPPED_PATTERNS = ("original/*", "*/original/*")
WEIGHT_PATTERNS = ("*.safetensors",)
MARKER = ".pdserve-source.json"  # written last: the fetch finished (see ``fetch``)
DEFAULT_REVISION = "main"


class ModelSourceError(ValueError):
    """The model is missing or could not be fetched; the message names the source."""


def describe(model: ModelSettings) -> str:
    """The source as a user wrote it, for error messages: ``model.hf_id 'org/name'``."""
    if model.hf_id is not None:
        revision = model.revision or DEFAULT_REVISION
        return f"model.hf_id {model.hf_id!r} (revision {revision!r})"
    if model.uri is not None:
        return f"model.uri {model.uri!r}"
    if model.path is not None:
        return f"model.path {model.path!r}"
    return f"model.test_model {model.test_model!r}"


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", part)


def cache_path(model: ModelSettings) -> Path:
    """The directory ``fetch`` fills for a hub or object-store source (no I/O): the same on
    every node, so the builder's path is valid where the replicas run."""
    root = Path(model.cache_dir).expanduser()
    if model.hf_id is not None:
        repo = "--".join(_safe(p) for p in model.hf_id.split("/"))
        return root / "hub" / repo / _safe(model.revision or DEFAULT_REVISION)
    if model.uri is not None:
        scheme, _, rest = model.uri.partition("://")
        parts = [_safe(p) for p in rest.split("/") if p not in ("", ".", "..")]
        return root.joinpath("uri", _safe(scheme), *parts)
    raise ValueError("cache_path: the model has no hf_id or uri")


def resolve(model: ModelSettings) -> Path:
    """The local model directory of a ``path``, ``hf_id`` or ``uri`` source, without
    downloading anything; ``ModelSourceError`` when it is not there."""
    source = describe(model)
    if model.path is not None:
        if model.hf_id is not None or model.uri is not None:  # a pinned copy of the fetch
            source = f"model.path {model.path!r} (where {source} was fetched)"
        directory = Path(model.path)
        if not directory.is_dir():
            raise ModelSourceError(
                f"{source} is not a directory (on Kubernetes: is the model volume mounted "
                "at that path on every Ray pod? see modelStorage.volume in the chart)"
            )
        if not (directory / "config.json").is_file():
            raise ModelSourceError(f"{source} has no config.json: not a Hugging Face model dir")
        return directory
    directory = cache_path(model)
    if not (directory / MARKER).is_file() or not (directory / "config.json").is_file():
        raise ModelSourceError(
            f"{source} is not in the model cache ({directory}); it is downloaded before Ray "
            "starts by the chart's init container, or by `python -m "
            "pdserve.deployments.model_source fetch --model '<model settings JSON>'`"
        )
    return directory


def fetch(
    model: ModelSettings, *, metadata_only: bool = False, endpoint: str | None = None
) -> Path:
    """Download a hub or object-store model into ``cache_path(model)`` unless a finished
    fetch is there already; returns the directory.

    ``metadata_only`` skips the weights (config and tokenizer only: what the head's app
    builder and ingress read). Pods of one node share the cache, so the fetch holds a lock
    file and writes ``MARKER`` last; an interrupted fetch resumes on the next try. The hub
    token comes from ``HF_TOKEN`` (the chart sets it from a Secret), object-store
    credentials from the environment that fsspec's backend reads.
    """
    if model.hf_id is None and model.uri is None:
        return resolve(model)  # a local path or the test model: nothing to download
    dest = cache_path(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _lock(dest.with_name(dest.name + ".lock")):
        if _finished(dest, need_weights=not metadata_only):
            return dest
        skipped = SKIPPED_PATTERNS + (WEIGHT_PATTERNS if metadata_only else ())
        if model.hf_id is not None:
            _fetch_hub(model, dest, skipped, endpoint)
        else:
            _fetch_uri(model, dest, skipped)
        _check_complete(model, dest, need_weights=not metadata_only)
        marker = {"source": describe(model), "weights": not metadata_only}
        (dest / MARKER).write_text(json.dumps(marker) + "\n")
    return dest


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _finished(dest: Path, *, need_weights: bool) -> bool:
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(marker.get("weights")) or not need_weights


def _wanted(relpath: str, skipped: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(relpath, p) for p in WANTED_PATTERNS) and not any(
        fnmatch.fnmatch(relpath, p) for p in skipped
    )


def _fetch_hub(model: ModelSettings, dest: Path, skipped: Sequence[str], endpoint: str | None):
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    source = describe(model)
    assert model.hf_id is not None
    try:
        snapshot_download(
            model.hf_id,
            revision=model.revision,
            local_dir=dest,
            allow_patterns=list(WANTED_PATTERNS),
            ignore_patterns=list(skipped),
            endpoint=endpoint,
        )
    except GatedRepoError as err:
        raise ModelSourceError(
            f"{source} is gated: accept its licence on the Hub with the account whose token "
            f"is in HF_TOKEN (the chart's modelStorage.hfTokenSecret) ({err})"
        ) from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"{source} was not found on the Hub, or it is private and HF_TOKEN (the chart's "
            "modelStorage.hfTokenSecret) is missing or has no access to it"
        ) from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"{source}: the revision does not exist") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        raise ModelSourceError(f"{source} could not be downloaded: {err}") from None


def _fetch_uri(model: ModelSettings, dest: Path, skipped: Sequence[str]) -> None:
    import fsspec  # a dependency of huggingface_hub and torch; backends (s3fs...) are extras

    source = describe(model)
    assert model.uri is not None
    try:
        fs, root = fsspec.core.url_to_fs(model.uri)
    except ImportError as err:  # fsspec names the package: "Install s3fs to access S3"
        raise ModelSourceError(f"{source}: {err} (pip install it into the image)") from None
    try:
        if not fs.isdir(root):
            raise ModelSourceError(f"{source}: no such directory in the object store")
        files = [f for f in fs.find(root) if _wanted(posixpath.relpath(f, root), skipped)]
        for remote in files:
            local = dest / posixpath.relpath(remote, root)
            local.parent.mkdir(parents=True, exist_ok=True)
            partial = local.with_name(local.name + ".partial")
            fs.get_file(remote, str(partial))
            os.replace(partial, local)  # a reader never sees half a file
    except ModelSourceError:
        raise
    except (OSError, ValueError) as err:  # fsspec backends raise OSError subclasses
        raise ModelSourceError(f"{source} could not be downloaded: {err}") from None


def _check_complete(model: ModelSettings, dest: Path, *, need_weights: bool) -> None:
    source = describe(model)
    if not (dest / "config.json").is_file():
        raise ModelSourceError(f"{source} has no config.json: not a Hugging Face model")
    if need_weights and not any(dest.rglob("*.safetensors")):
        raise ModelSourceError(f"{source} has no *.safetensors weights (pdserve loads only those)")


def main(argv: Sequence[str] | None = None) -> int:
    """``fetch`` (download, print the directory) or ``resolve`` (print it, no download)."""
    from pdserve.deployments.config import ModelSettings

    parser = argparse.ArgumentParser(prog="python -m pdserve.deployments.model_source")
    parser.add_argument("command", choices=["fetch", "resolve"])
    parser.add_argument(
        "--model", required=True, help="ModelSettings as JSON (AppConfig's model section)"
    )
    parser.add_argument(
        "--metadata-only", action="store_true", help="config and tokenizer, no weights"
    )
    parser.add_argument(
        "--endpoint",
        default=os.environ.get("HF_ENDPOINT"),
        help="Hugging Face Hub endpoint (default: $HF_ENDPOINT, else the public Hub)",
    )
    args = parser.parse_args(argv)
    try:
        model = ModelSettings.model_validate_json(args.model)
    except ValueError as err:
        print(f"pdserve model source: invalid --model: {err}", file=sys.stderr)
        return 2
    try:
        if args.command == "fetch":
            directory = fetch(model, metadata_only=args.metadata_only, endpoint=args.endpoint)
        else:
            directory = resolve(model)
    except ModelSourceError as err:
        print(f"pdserve model source: {err}", file=sys.stderr)
        return 1
    print(directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
