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

# `make bench-node` (issue 14): K local ranks through one sidecar against the same K
# reading the decoded files directly, the cold epoch beside an all-core decode ceiling,
# control latency, sidecar CPU per request, PSS. Not part of `make test` (its smoke run
# is: tests/integration/test_bench_node_smoke.py). The defaults fit a 2-core machine in
# under two minutes; bench/node_device.sh is the 16-core run (6 GiB, 48 shards).
#: Token bytes to generate (file:// on /dev/shm by default).
BENCH_NODE_SIZE ?= 512MiB
BENCH_NODE_SHARDS ?= 32
#: Rank counts; those above the usable cores (cgroup CPU quota) print n/a.
BENCH_NODE_KS ?= 1,2,4,8,16
#: e.g. BENCH_NODE_ARGS='--minio $(MINIO_DIR)/minio' (after `make tools-minio`).
BENCH_NODE_ARGS ?=

.PHONY: bench-node
bench-node: install
	nice $(PY) -m bench.node --size $(BENCH_NODE_SIZE) --shards $(BENCH_NODE_SHARDS) \
	  --ks $(BENCH_NODE_KS) $(BENCH_NODE_ARGS)

# `make bench-sample`: sample mode's warm tokens/s against block mode's, one run
# (bench/sample_read.py; the target is sample >= 0.5x block).
BENCH_SAMPLE_SIZE ?= 256MiB
.PHONY: bench-sample
bench-sample: install
	nice $(PY) -m bench.sample_read --size $(BENCH_SAMPLE_SIZE)

# `make bench-gather`: the read path alone, block slices against sample mode's gather and
# against a gather of packed rows (one memmove per row), the copy's floor here
# (bench/gather_floor.py; docs/benchmarks.md reads it).
.PHONY: bench-gather
bench-gather: install
	nice $(PY) -m bench.gather_floor --size $(BENCH_SAMPLE_SIZE)

# `make bench-shuffle-quality`: each loader's shuffle measured on one epoch (mean uid
# distance between neighbours in a batch, source files per batch); needs the bench extra
# for the peers' rows (bench/shuffle_quality.py; docs/reading-plan.md has the table).
BENCH_QUALITY_SIZE ?= 1GiB
.PHONY: bench-shuffle-quality
bench-shuffle-quality: install bench-deps
	LITDATA_DISABLE_VERSION_CHECK=1 nice $(PY) -m bench.shuffle_quality --size $(BENCH_QUALITY_SIZE)
