# `make bench-operator` (issue 18): the operator at cluster scale against the loopback
# control plane (started if not up, with extra kwok fake nodes so every pod fits):
# labelled against unlabelled admission bursts, webhook latency, operator CPU and API
# requests per pod, 500 DatasetMounts to Ready, idle and gone. Not part of `make test`;
# docs/benchmarks.md has the method and the figures.
BENCH_OPERATOR_ARGS ?=

.PHONY: bench-operator
# nice: the machine has two cores shared with other work; the ratios are what count.
bench-operator: install $(CLUSTER_TOOLS)
	nice $(PY) -m bench.operator $(BENCH_OPERATOR_ARGS)
