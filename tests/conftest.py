"""Shared pytest fixtures: the deterministic test models (generated once, then cached).

The cache directory is ``$PDSERVE_MODEL_CACHE`` if set, else ``models/`` at the repository
root (git-ignored). Models are written by ``pdserve.engine.testmodel`` from a fixed seed and the
shipped corpus, so every machine gets the same files without a download.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Triton decides at import whether it interprets; some test modules import it indirectly
# (transformers does) before tests/kernels/conftest.py runs. Without CUDA the compiled
# kernels are never used, so interpret everywhere from the start.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The repository root must never be on a test process's sys.path: there its folders import
# as top-level ``kernels``, ``engine``... and shadow same-named packages (transformers imports
# Hugging Face's ``kernels``). Python processes the tests start (``python -m pdserve...``)
# would put their working directory first (Python 3.11+ honours PYTHONSAFEPATH), and Ray puts
# its driver's working directory first on every worker's path. Yet spawned workers and Ray
# replicas must import the test helpers (``tests.*``). So the session runs from a directory
# of its own whose only entry is ``tests``, and child processes find it on PYTHONPATH.
os.environ.setdefault("PYTHONSAFEPATH", "1")
_IMPORT_ROOT = Path(tempfile.mkdtemp(prefix="pdserve-tests-"))
(_IMPORT_ROOT / "tests").symlink_to(Path(__file__).resolve().parent, target_is_directory=True)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(_IMPORT_ROOT), os.environ.get("PYTHONPATH", "")) if p
)
sys.path.insert(0, str(_IMPORT_ROOT))  # multiprocessing's spawn hands children this sys.path
os.chdir(_IMPORT_ROOT)
atexit.register(shutil.rmtree, _IMPORT_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    from pdserve.engine.testmodel import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def test_model(model_cache_dir: Path) -> Callable[[str], Path]:
    """Factory: ``test_model("tiny" | "small" | "llama3-gqa" | "qwen2" | "mqa") -> model dir``."""
    from pdserve.engine.testmodel import ensure_test_model

    return lambda name: ensure_test_model(name, model_cache_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(test_model: Callable[[str], Path]) -> Path:
    """The tiny Llama (GQA, float32, ~1M params) with its locally trained tokenizer."""
    return test_model("tiny")


# The session's exit status, kept for ``pytest_unconfigure``.
_session_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _session_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the test process once every plugin is done: run the exit handlers (shared-memory
    segments, Ray), then leave with the session's status, without the interpreter's final
    teardown, which can die with SIGSEGV after the tests (docs/decisions.md, decision 8).
    ``PDSERVE_TEST_FULL_TEARDOWN=1`` keeps the ordinary exit."""
    if not _session_status or os.environ.get("PDSERVE_TEST_FULL_TEARDOWN") == "1":
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_session_status[-1])
