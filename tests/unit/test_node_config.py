"""The real node's configuration (tests/cluster/network.py, node.py), checked without
starting anything: what keeps its traffic on this machine and its processes off the
host's defaults."""

from __future__ import annotations

import ipaddress
import pathlib

import pytest

from tests.cluster import network, node

pytestmark = pytest.mark.unit

TEST_NET = ipaddress.ip_network("198.18.0.0/15")


def test_every_address_and_range_of_the_node_is_inside_the_benchmarking_net() -> None:
    for cidr in (network.POD_CIDR, network.SERVICE_CIDR):
        assert ipaddress.ip_network(cidr).subnet_of(TEST_NET), cidr  # type: ignore[arg-type]
    for addr in (network.HOST_ADDRESS, network.POD_RANGE_START, network.KUBERNETES_SERVICE_IP):
        assert ipaddress.ip_address(addr) in TEST_NET, addr
    assert ipaddress.ip_address(network.KUBERNETES_SERVICE_IP) in ipaddress.ip_network(
        network.SERVICE_CIDR
    )


def test_cni_bridge_is_no_gateway_no_masquerade_and_routes_only_services_via_the_host() -> None:
    conf = network.cni_config(pathlib.Path("/state/ipam"))
    bridge = conf["plugins"][0]  # type: ignore[index]
    assert bridge["type"] == "bridge" and bridge["bridge"] == network.BRIDGE
    assert bridge["isGateway"] is False and bridge["ipMasq"] is False
    ipam = bridge["ipam"]
    assert ipam["dataDir"] == "/state/ipam"  # not /var/lib/cni
    ((pod_range,),) = ipam["ranges"]
    assert pod_range["gateway"] == network.HOST_ADDRESS  # never handed to a pod
    assert ipam["routes"] == [{"dst": network.SERVICE_CIDR, "gw": network.HOST_ADDRESS}]
    assert [p["type"] for p in conf["plugins"]] == ["bridge", "portmap", "loopback"]  # type: ignore[union-attr]


def test_containerd_keeps_to_the_cluster_dir_and_the_cri_settings_this_machine_needs() -> None:
    paths = node.Paths(pathlib.Path("/c/node"))
    text = node.containerd_config(paths, sandbox_image="shardcache.test/pause:abc")
    assert 'address = "/c/node/containerd/containerd.sock"' in text
    assert 'root = "/c/node/containerd/root"' in text and "/run/containerd" not in text
    for setting in (
        'sandbox_image = "shardcache.test/pause:abc"',
        "restrict_oom_score_adj = true",
        "SystemdCgroup = false",
        'bin_dir = "/usr/lib/cni"',
        "netns_mounts_under_state_dir = true",
    ):
        assert setting in text, setting
    env = node.containerd_env()
    assert env["HTTPS_PROXY"] == env["HTTP_PROXY"] == node.NO_PULL_PROXY
    assert env["NO_PROXY"] == ""


def test_kubelet_uses_cgroupfs_the_bridge_address_and_registers_tainted() -> None:
    paths = node.Paths(pathlib.Path("/c/node"))
    config = node.kubelet_config(
        paths,
        port=1,
        healthz_port=2,
        ca_file=pathlib.Path("/ca"),
        cert_file=pathlib.Path("/crt"),
        key_file=pathlib.Path("/key"),
    )
    assert config["cgroupDriver"] == "cgroupfs" and config["cgroupsPerQOS"] is True
    assert config["failSwapOn"] is False and config["failCgroupV1"] is False
    assert config["address"] == network.HOST_ADDRESS
    assert config["containerRuntimeEndpoint"] == "unix:///c/node/containerd/containerd.sock"
    assert config["registerWithTaints"] == [node.REAL_NODE_TAINT]
    assert config["podLogsDir"] == "/c/node/pod-logs"
    argv = node.kubelet_argv(pathlib.Path("/bin/kubelet"), paths, kubeconfig=pathlib.Path("/k"))
    assert f"--node-ip={network.HOST_ADDRESS}" in argv
    assert f"--node-labels={node.REAL_NODE_LABEL}=true" in argv


def test_kube_proxy_leaves_host_sysctls_and_loopback_alone() -> None:
    config = node.proxy_config(kubeconfig=pathlib.Path("/k"), healthz_port=1, metrics_port=2)
    assert config["mode"] == "iptables"
    assert config["iptables"] == {"localhostNodePorts": False, "masqueradeAll": False}
    conntrack = config["conntrack"]
    assert conntrack["maxPerCore"] == 0 and conntrack["min"] == 0  # type: ignore[index]


def test_iptables_rules_printed_with_quoted_comments_are_split_back_into_arguments() -> None:
    rule = [
        "PREROUTING",
        "-m",
        "comment",
        "--comment",
        '"kubernetes',
        "service",
        'portals"',
        "-j",
        "KUBE-SERVICES",
    ]
    assert network._unquote(rule) == [
        "PREROUTING",
        "-m",
        "comment",
        "--comment",
        "kubernetes service portals",
        "-j",
        "KUBE-SERVICES",
    ]
