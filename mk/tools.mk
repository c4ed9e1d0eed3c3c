# Go-built test tools, each built once into $(TOOLS_CACHE)/<name>-<version>/ and reused by
# every later run and every fresh clone on this machine. Versions: tests/cluster/versions.env.
# The targets are the binaries themselves with no prerequisites, so a second `make` is a
# no-op; bumping a version changes the path and so builds the new one.
include tests/cluster/versions.env

BUILD_TOOL := tests/cluster/build.sh
MINIO_DIR := $(TOOLS_CACHE)/minio-$(MINIO_VERSION)
KUBE_DIR := $(TOOLS_CACHE)/kubernetes-$(KUBE_VERSION)
KUBENODE_DIR := $(TOOLS_CACHE)/kubenode-$(KUBE_VERSION)
ETCD_DIR := $(TOOLS_CACHE)/etcd-$(ETCD_VERSION)
HELM_DIR := $(TOOLS_CACHE)/helm-$(HELM_VERSION)
KWOK_DIR := $(TOOLS_CACHE)/kwok-$(KWOK_VERSION)
PROMETHEUS_DIR := $(TOOLS_CACHE)/prometheus-$(PROMETHEUS_VERSION)

.PHONY: tools tools-minio tools-kubernetes tools-kubenode tools-etcd tools-helm tools-kwok tools-prometheus
tools: tools-minio tools-kubernetes tools-kubenode tools-etcd tools-helm tools-kwok tools-prometheus
tools-minio: $(MINIO_DIR)/minio
tools-kubernetes: $(KUBE_DIR)/kube-apiserver
tools-kubenode: $(KUBENODE_DIR)/kubelet
tools-etcd: $(ETCD_DIR)/etcd
tools-helm: $(HELM_DIR)/helm
tools-kwok: $(KWOK_DIR)/kwok
tools-prometheus: $(PROMETHEUS_DIR)/prometheus

# build.sh builds into a temporary directory and renames it, so the binary exists only
# when the whole build succeeded; it also takes a lock in $(TOOLS_CACHE), so under -j (or
# with two clones) the multi-minute compiles run one at a time instead of fighting over
# two cores.
$(MINIO_DIR)/minio:
	$(BUILD_TOOL) minio $(MINIO_VERSION) $(MINIO_DIR)
$(KUBE_DIR)/kube-apiserver:
	$(BUILD_TOOL) kubernetes $(KUBE_VERSION) $(KUBE_DIR)
$(KUBENODE_DIR)/kubelet:
	$(BUILD_TOOL) kubenode $(KUBE_VERSION) $(KUBENODE_DIR)
$(ETCD_DIR)/etcd:
	$(BUILD_TOOL) etcd $(ETCD_VERSION) $(ETCD_DIR)
$(HELM_DIR)/helm:
	$(BUILD_TOOL) helm $(HELM_VERSION) $(HELM_DIR)
$(KWOK_DIR)/kwok:
	$(BUILD_TOOL) kwok $(KWOK_VERSION) $(KWOK_DIR)
$(PROMETHEUS_DIR)/prometheus:
	$(BUILD_TOOL) prometheus $(PROMETHEUS_VERSION) $(PROMETHEUS_DIR)

TEST_PREREQS += tools-minio tools-kubernetes tools-kubenode tools-etcd tools-helm tools-kwok tools-prometheus
