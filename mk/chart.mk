# The Helm chart and the e2e tier (docs/e2e.md).
#   make chart               helm lint --strict, then package helm/shardcache into dist/
#   make e2e                 the e2e suite against the loopback control plane (default)
#   make e2e CLUSTER=kind    the same suite against a kind cluster: builds the image
#                            archives (mk/images.mk), creates the cluster if missing,
#                            `kind load image-archive`s them.
#                            Needs docker, kind, helm, kubectl on PATH and an S3 endpoint
#                            (SHARDCACHE_E2E_S3_*); it cannot run on the project machine.
CLUSTER ?= local
KIND_CLUSTER_NAME ?= shardcache-e2e
CHART_KUBE_VERSION = $(patsubst v%,%,$(KUBE_VERSION))

.PHONY: chart e2e e2e-local e2e-kind
chart: tools-helm
	python3 helm/monitoring/dashboard.py --check
	$(HELM_DIR)/helm lint --strict helm/shardcache --kube-version $(CHART_KUBE_VERSION)
	mkdir -p dist
	$(HELM_DIR)/helm package helm/shardcache --destination dist

e2e: e2e-$(CLUSTER)

e2e-local: install tools-minio tools-kubernetes tools-etcd tools-helm tools-kwok tools-prometheus
	SHARDCACHE_E2E_CLUSTER=local $(PY) -m pytest tests/e2e $(PYTEST_ARGS)

# The archives `make image-archives` builds are what kind's node imports (with
# containerd, like the local node tier): no docker build, no registry.
e2e-kind: install image-archives tools-prometheus
	@command -v kind >/dev/null || { echo "make e2e CLUSTER=kind: kind is not on PATH"; exit 2; }
	kind get clusters | grep -qx '$(KIND_CLUSTER_NAME)' || kind create cluster --name '$(KIND_CLUSTER_NAME)' --wait 120s
	for archive in $$($(PY) -c 'from images import build; print(" ".join(str(a.path) for a in build.archives().values()))'); do \
		kind load image-archive --name '$(KIND_CLUSTER_NAME)' $$archive || exit 1; \
	done
	SHARDCACHE_E2E_CLUSTER=kind KIND_CLUSTER_NAME='$(KIND_CLUSTER_NAME)' $(PY) -m pytest tests/e2e $(PYTEST_ARGS)
