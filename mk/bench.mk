# `make bench-peers`: shardcache side by side with MosaicML Streaming, LitData, pyarrow
# and a torch DataLoader (docs/benchmarks.md). Not part of `make test`: its peers need
# the `bench` extra (torch pulls CUDA runtime wheels, about 6 GiB installed; see
# docs/benchmarks.md), so only the torch-free smoke run is in the test suite.
BENCH_STAMP := $(VENV)/.bench-installed-stamp
#: Token bytes to generate (the Parquet is smaller: snappy).
BENCH_PEERS_SIZE ?= 1GiB
#: Work directory for the dataset and its conversions (reused when unchanged).
BENCH_PEERS_ROOT ?= $(HOME)/.cache/shardcache-bench-peers
BENCH_PEERS_ARGS ?=

.PHONY: bench-deps bench-peers
bench-deps: $(BENCH_STAMP)
$(BENCH_STAMP): pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $@

# nice: the machine has two cores and the run takes minutes; the ratios are what count.
bench-peers: install bench-deps
	nice $(PY) -m bench.peers.harness --size $(BENCH_PEERS_SIZE) --root $(BENCH_PEERS_ROOT) \
	  --docs docs/benchmarks.md --chart docs/benchmarks-peers.png \
	  --json $(BENCH_PEERS_ROOT)/results.json $(BENCH_PEERS_ARGS)
