#!/bin/sh
# Run pdserve.bench.gpu_verify from this checkout without installing pdserve (the device
# image has no pip install of it): the folders are mapped to pdserve.* only by setuptools'
# package-dir, so build a pdserve/ symlink farm in a temp dir and put it on PYTHONPATH.
#   bench/gpu_verify.sh --out DIR [--dry-run] [--quick] [--steps ...]
# PYTHON picks the interpreter (python3). -P keeps the caller's directory off sys.path: from
# the repo root its kernels/ would shadow Hugging Face's `kernels` package.
#
# On the device image (no pydantic): carry its wheels (see the device tool's README), e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 \
#     annotated-types==0.8.0 typing-inspection==0.4.5
# and run: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   PYTHONPATH=/tmp/site bench/gpu_verify.sh --out $OUT
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
farm=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-farm.XXXXXX")
trap 'rm -rf "$farm"' EXIT
mkdir "$farm/pdserve"
for d in bench cluster deployments engine kernels kvtransfer sim; do
    ln -s "$root/$d" "$farm/pdserve/$d"
done
PYTHONPATH="$farm${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -P -m pdserve.bench.gpu_verify "$@"
