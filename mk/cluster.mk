# A real control plane on loopback for e2e tests and by hand (tests/cluster/cluster.py):
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok's fake nodes,
# and the real node (containerd, kubelet, kube-proxy; mk/node.mk) unless SHARDCACHE_NODE=0.
# `make cluster-up` leaves .cluster/kubeconfig, .cluster/bin/helm and .cluster/bin/kubectl;
# a second call finds it up. `make cluster-down` stops everything it started.
CLUSTER_TOOLS := tools-kubernetes tools-etcd tools-helm tools-kwok

.PHONY: cluster-up cluster-down cluster-status
cluster-up: install $(CLUSTER_TOOLS)
	$(PY) tests/cluster/cluster.py up
cluster-down: install
	$(PY) tests/cluster/cluster.py down
cluster-status: install
	$(PY) tests/cluster/cluster.py status
