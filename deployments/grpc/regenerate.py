"""Regenerate ``pdserve_pb2.py``, ``.pyi`` and ``pdserve_pb2_grpc.py`` from ``pdserve.proto``
(``python -m pdserve.deployments.grpc.regenerate``).

protoc names generated modules after the proto's path, so the proto is compiled from a
temporary tree where it sits at ``pdserve/deployments/grpc/``: the generated code then
imports ``pdserve.deployments.grpc.pdserve_pb2``, never a top-level ``pdserve_pb2``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE_PATH = Path("pdserve", "deployments", "grpc")
OUTPUTS = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


def regenerate() -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / PACKAGE_PATH
        tree.mkdir(parents=True)
        shutil.copy(HERE / "pdserve.proto", tree / "pdserve.proto")
        args = [
            "protoc",
            f"-I{tmp}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PACKAGE_PATH / "pdserve.proto"),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for name in OUTPUTS:
            shutil.copy(tree / name, HERE / name)


if __name__ == "__main__":
    regenerate()
