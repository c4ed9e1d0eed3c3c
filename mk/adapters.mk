# The framework adapters' test dependencies (issue 16): torch (CPU is enough; PyPI's
# wheel pulls the CUDA runtime wheels, about 2.8 GB to download and 6 GiB installed,
# once per machine: pip caches the wheels), torchdata's StatefulDataLoader (a test
# dependency only: the adapter speaks its protocol without importing it) and JAX (CPU).
ADAPTERS_STAMP := $(VENV)/.adapters-installed-stamp

.PHONY: adapters-deps bench-gpu
adapters-deps: $(ADAPTERS_STAMP)
$(ADAPTERS_STAMP): pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet -e '.[torch,jax]' 'torchdata>=0.8'
	touch $@

TEST_PREREQS += adapters-deps
# mypy checks the adapters against the frameworks' own annotations.
typecheck: adapters-deps

# `make bench-gpu`: tokens per second into GPU memory through the device prefetcher,
# for 1 and 8 local ranks, beside the pinned host-to-device limit measured in the same
# run (bench/gpu.py). Without a GPU it reports n/a and measures the CPU side.
# bench/gpu_device.sh is the same run as one prepared command for a GPU machine.
BENCH_GPU_ARGS ?=
bench-gpu: install adapters-deps
	nice $(PY) -m bench.gpu $(BENCH_GPU_ARGS)
