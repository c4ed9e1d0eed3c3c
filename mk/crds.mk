# The DatasetMount CRD is generated from the spec model; tests/unit/test_crd.py checks
# that the committed file matches.
.PHONY: crds
crds: install
	$(PY) -m shardcache_operator.crd > crds/datasetmount.yaml
