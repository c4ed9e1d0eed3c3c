# The real node of the test cluster (tests/cluster/node.py, docs/e2e.md "The node tier"):
# Debian's containerd, runc, CNI plugins and iptables, installed with apt-get when
# missing, and gcc for the static pause and toolbox images. kubelet and kube-proxy come
# from tools-kubenode (mk/tools.mk). SHARDCACHE_NODE=0 leaves the node out everywhere.
NODE_PACKAGES := containerd runc containernetworking-plugins iptables gcc libc6-dev
NODE_SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
SHARDCACHE_NODE ?= 1
export SHARDCACHE_NODE

.PHONY: node-packages pytest-node
node-packages:
	@missing=$$(for p in $(NODE_PACKAGES); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; \
	done); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing (Debian packages)"; \
		$(NODE_SUDO) apt-get -o DPkg::Lock::Timeout=600 update -qq && \
		DEBIAN_FRONTEND=noninteractive $(NODE_SUDO) apt-get -o DPkg::Lock::Timeout=600 \
			install -y -qq $$missing >/dev/null; \
	fi

ifneq ($(SHARDCACHE_NODE),0)
NODE_PREREQS := node-packages tools-kubenode
# The node tier is a pytest session of its own: its last test takes the cluster down.
test: pytest-node
# (Prerequisites are expanded as each file is read, and mk/*.mk come in name order: the
# node's are added to the other files' targets here.)
cluster-up e2e-local: $(NODE_PREREQS)
endif
TEST_PREREQS += $(NODE_PREREQS)

# The product tests run MinIO on the bridge and the images built here: both must exist
# before this session, which `make test` may run before the main one.
pytest-node: install tools-minio image-archives $(CLUSTER_TOOLS) $(NODE_PREREQS)
	$(PY) -m pytest tests/node $(PYTEST_ARGS)
