# The verbs. `make demo` and `make test` are the README's two commands: each installs
# what it needs by itself (the .venv here, Debian packages, Go-built binaries cached
# outside the repo under $(TOOLS_CACHE)).
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Go-built binaries (MinIO, etcd, kube-apiserver, helm, ...) are cached by version here,
# outside the repo, so a fresh clone on the same machine reuses them.
TOOLS_CACHE ?= $(HOME)/.cache/shardcache-tools
export TOOLS_CACHE

# Sub-makefiles append to these: prerequisites of `make test` and of the pytest run.
TEST_PREREQS :=
PYTEST_ARGS ?=

-include mk/*.mk

.PHONY: help install demo test lint typecheck layers pytest bench-read
help:
	@echo "make demo   - run the data path end to end on this machine (no cluster)"
	@echo "make test   - lint, types, layering, then unit, integration and e2e tests, and the node tier (a real kubelet; SHARDCACHE_NODE=0 leaves it out)"
	@echo "make bench-read / bench-ckpt / bench-peers / bench-sample / bench-gather / bench-shuffle-quality / bench-node / bench-gpu / bench-operator - benchmarks (not tests)"
	@echo "make soak   - the crash matrix at random, >= 100 kills (nightly; not in make test)"
	@echo "make flake-check - make test 3 times on fresh clones with a CPU burner (not in make test)"
	@echo "make cluster-up / cluster-down - a real API server on loopback (.cluster/kubeconfig)"
	@echo "make e2e [CLUSTER=kind] - the e2e tier alone; make chart - lint and package the chart"
	@echo "make crds - regenerate crds/ from the spec model"

install: $(STAMP)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[sidecar,operator,dev]'
	touch $(STAMP)

demo: install tools-minio
	$(VENV)/bin/shardcache demo --minio $(MINIO_DIR)/minio

lint: install
	$(VENV)/bin/ruff check shardcache sidecar operator images tests bench
	$(VENV)/bin/ruff format --check shardcache sidecar operator images tests bench

typecheck: install
	$(VENV)/bin/mypy shardcache sidecar/shardcache_sidecar operator/shardcache_operator images bench

layers: install
	$(VENV)/bin/lint-imports

pytest: install $(TEST_PREREQS)
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint typecheck layers pytest

bench-read: install tools-minio
	$(PY) -m bench.read --minio $(MINIO_DIR)/minio
