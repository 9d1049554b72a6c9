# pdserve: two commands do all the set-up.
#   make serve   create .venv if missing, install, start a local multi-node Ray cluster on
#                loopback and serve the default model, prefill and decode disaggregated
#   make test    create .venv if missing, install, run the tests
#   make lint    ruff (style) and mypy (types) over the source
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
STAMP_DEV := $(VENV)/.pdserve-dev-installed
CONFIG ?=
PYTEST_ARGS ?=

.PHONY: install serve test lint clean image

$(PY):
	$(PYTHON) -m venv $(VENV)

# Without a GPU take the CPU torch wheel first, so the project's torch range is already
# satisfied and pip never pulls multi-GB CUDA wheels. `serve` needs only the runtime
# dependencies; `test` adds the dev extra (pytest, triton for the kernel interpreter, ...).
$(STAMP): pyproject.toml | $(PY)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e .
	@touch $(STAMP)

$(STAMP_DEV): $(STAMP)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q triton==3.5.1; \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP_DEV)

install: $(STAMP_DEV)

serve: $(STAMP)
	$(VENV)/bin/pdserve run $(CONFIG)

# The pytest script, not `python -m pytest`: -m would put the repository root on sys.path,
# where its folders shadow same-named packages (Hugging Face's `kernels`).
test: $(STAMP_DEV)
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

# mypy reads its settings (which packages, where they are) from pyproject.toml.
lint: $(STAMP_DEV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info

# The container image the Helm chart runs (see Dockerfile): VARIANT=cuda (default) or cpu;
# the tag is the project's version (+ -cpu), as helm/pdserve's image values expect.
DOCKER ?= docker
IMAGE ?= ghcr.io/pdserve/pdserve
VARIANT ?= cuda
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_TAG ?= $(VERSION)$(if $(filter cpu,$(VARIANT)),-cpu,)

image:
	@command -v $(DOCKER) >/dev/null 2>&1 || { \
		echo "make image: '$(DOCKER)' not found; install Docker (or set DOCKER=podman) to build $(IMAGE):$(IMAGE_TAG)" >&2; exit 1; }
	@$(DOCKER) info >/dev/null 2>&1 || { \
		echo "make image: '$(DOCKER)' cannot reach a daemon (is dockerd running?); cannot build $(IMAGE):$(IMAGE_TAG)" >&2; exit 1; }
	$(DOCKER) build --build-arg VARIANT=$(VARIANT) -t $(IMAGE):$(IMAGE_TAG) .
