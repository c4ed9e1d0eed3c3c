"""The real node: a kubelet + containerd runs pods the project built, on a bridge that
leads nowhere, and `cluster down` leaves the machine as it found it.

The pods use only the node tier's own toolbox image (tests/cluster/toolbox.c, static),
imported into the node's containerd; nothing is pulled. The tests run in order: the last
two kill the node and take the cluster down.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import os
import pathlib
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from typing import Any

import kubernetes.client
import pytest

from tests.cluster import network, node, oci
from tests.support import cluster

pytestmark = pytest.mark.node

#: A pod's start here is sandbox + CNI + two containers: seconds; a busy machine, more.
POD_READY_TIMEOUT_S = 120.0
RUN_VOLUME_SIZE_LIMIT = "8Mi"


@pytest.fixture(scope="session")
def preexisting_cluster() -> bool:
    """Whether `make cluster-up` had the cluster up before this session (the last test
    brings it back up then)."""
    return cluster.cluster_is_up()


@pytest.fixture(scope="session")
def real_node(preexisting_cluster: bool, kube_cluster: cluster.KubeCluster) -> dict[str, Any]:
    state = json.loads((cluster.CLUSTER_DIR / "state.json").read_text())
    if not state.get("node"):
        pytest.fail(
            "the cluster is up without its real node (SHARDCACHE_NODE=0?); the node tier "
            "needs it: `make cluster-down`, then run again",
            pytrace=False,
        )
    info: dict[str, Any] = state["node"]
    return info


@pytest.fixture
def core(kube_cluster: cluster.KubeCluster) -> Iterator[kubernetes.client.CoreV1Api]:
    client = kube_cluster.api_client()
    try:
        yield kubernetes.client.CoreV1Api(client)
    finally:
        client.close()  # type: ignore[no-untyped-call]


@pytest.fixture
def namespace(core: kubernetes.client.CoreV1Api) -> Iterator[str]:
    name = f"node-{os.urandom(3).hex()}"
    core.create_namespace(
        kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name))
    )
    try:
        yield name
    finally:
        core.delete_namespace(name, grace_period_seconds=0)


def toolbox(real_node: dict[str, Any]) -> str:
    names = [n for n in real_node["images"] if "/toolbox:" in n]
    assert names, f"no toolbox image among {real_node['images']}"
    return str(names[0])


def real_node_pod(name: str, image: str) -> dict[str, Any]:
    """A pod with a native sidecar and a memory-backed volume, steered to the real node."""
    mount = {"name": "run", "mountPath": "/run/shared"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": {node.REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": node.REAL_NODE_LABEL, "operator": "Exists"}],
            "initContainers": [
                {
                    "name": "sidecar",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "restartPolicy": "Always",
                    "args": ["sleep", "/run/shared/ready"],
                    "startupProbe": {
                        "exec": {"command": ["/toolbox", "cat", "/run/shared/ready"]},
                        "periodSeconds": 1,
                        "failureThreshold": 30,
                    },
                    "volumeMounts": [mount],
                }
            ],
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "args": ["sleep"],
                    "volumeMounts": [mount],
                    "resources": {"limits": {"memory": "32Mi", "cpu": "100m"}},
                }
            ],
            "volumes": [
                {
                    "name": "run",
                    "emptyDir": {"medium": "Memory", "sizeLimit": RUN_VOLUME_SIZE_LIMIT},
                }
            ],
        },
    }


def wait_ready(core: kubernetes.client.CoreV1Api, namespace: str, name: str) -> Any:
    deadline = time.monotonic() + POD_READY_TIMEOUT_S
    pod = None
    while time.monotonic() < deadline:
        pod = core.read_namespaced_pod(name, namespace)
        conditions = pod.status.conditions or []
        if any(c.type == "Ready" and c.status == "True" for c in conditions):
            return pod
        time.sleep(0.5)
    events = core.list_namespaced_event(namespace).items
    raise AssertionError(
        f"pod {name} not Ready in {POD_READY_TIMEOUT_S:.0f}s: "
        f"{pod.status if pod else None}\nevents: {[(e.reason, e.message) for e in events]}"
    )


def kubectl(kube_cluster: cluster.KubeCluster, *args: str) -> str:
    result = subprocess.run(
        [str(kube_cluster.kubectl), f"--kubeconfig={kube_cluster.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stdout}{result.stderr}"
    return result.stdout


def test_real_node_registers_ready_with_its_address_label_and_taint(
    real_node: dict[str, Any], core: kubernetes.client.CoreV1Api
) -> None:
    got = core.read_node(node.NODE_NAME)
    assert any(c.type == "Ready" and c.status == "True" for c in got.status.conditions)
    assert got.metadata.labels[node.REAL_NODE_LABEL] == "true"
    # (The node controller's own not-ready taint may still be on its way out.)
    assert (node.REAL_NODE_LABEL, "true", "NoSchedule") in [
        (t.key, t.value, t.effect) for t in got.spec.taints or []
    ]
    addresses = {a.type: a.address for a in got.status.addresses}
    assert addresses["InternalIP"] == network.HOST_ADDRESS
    info = got.status.node_info
    assert info.kubelet_version == "v1.34.4"
    assert info.container_runtime_version.startswith("containerd://1.6.")


def test_native_sidecar_and_memory_volume_run_on_the_real_node_with_exec_and_logs(
    real_node: dict[str, Any],
    kube_cluster: cluster.KubeCluster,
    core: kubernetes.client.CoreV1Api,
    namespace: str,
) -> None:
    core.create_namespaced_pod(namespace, real_node_pod("smoke", toolbox(real_node)))
    pod = wait_ready(core, namespace, "smoke")

    assert pod.spec.node_name == node.NODE_NAME
    assert ipaddress.ip_address(pod.status.pod_ip) in ipaddress.ip_network(network.POD_CIDR)
    (sidecar,) = pod.status.init_container_statuses
    (main,) = pod.status.container_statuses
    assert sidecar.started and sidecar.ready and main.ready
    # The startup probe gated the main container: it started after the sidecar did.
    assert sidecar.state.running.started_at <= main.state.running.started_at

    mounts = kubectl(
        kube_cluster,
        "-n",
        namespace,
        "exec",
        "smoke",
        "-c",
        "main",
        "--",
        "/toolbox",
        "cat",
        "/proc/mounts",
    )
    (run_mount,) = [line.split() for line in mounts.splitlines() if " /run/shared " in line]
    assert run_mount[2] == "tmpfs", run_mount
    assert "size=8192k" in run_mount[3].split(","), run_mount  # the sizeLimit, on the tmpfs
    ready = kubectl(
        kube_cluster,
        "-n",
        namespace,
        "exec",
        "smoke",
        "-c",
        "main",
        "--",
        "/toolbox",
        "cat",
        "/run/shared/ready",
    )
    assert ready == "ready\n"  # written by the sidecar into the shared volume
    logs = kubectl(kube_cluster, "-n", namespace, "logs", "smoke", "-c", "sidecar")
    assert "toolbox: started" in logs


def test_pod_reaches_the_kubernetes_service_through_kube_proxy(
    real_node: dict[str, Any],
    kube_cluster: cluster.KubeCluster,
    core: kubernetes.client.CoreV1Api,
    namespace: str,
) -> None:
    service = core.read_namespaced_service("kubernetes", "default")
    assert service.spec.cluster_ip == network.KUBERNETES_SERVICE_IP
    endpoints = core.read_namespaced_endpoints("kubernetes", "default")
    assert [a.ip for s in endpoints.subsets for a in s.addresses] == [network.HOST_ADDRESS]

    core.create_namespaced_pod(namespace, real_node_pod("client", toolbox(real_node)))
    wait_ready(core, namespace, "client")
    environ = kubectl(
        kube_cluster,
        "-n",
        namespace,
        "exec",
        "client",
        "-c",
        "main",
        "--",
        "/toolbox",
        "cat",
        "/proc/self/environ",
    )
    assert f"KUBERNETES_SERVICE_HOST={network.KUBERNETES_SERVICE_IP}" in environ.split("\0")
    # Nothing listens on the ClusterIP itself: only kube-proxy's DNAT to the API server
    # on the bridge makes this connect.
    out = kubectl(
        kube_cluster,
        "-n",
        namespace,
        "exec",
        "client",
        "-c",
        "main",
        "--",
        "/toolbox",
        "connect",
        network.KUBERNETES_SERVICE_IP,
        "443",
    )
    assert out == f"connected {network.KUBERNETES_SERVICE_IP}:443\n"


def test_root_init_container_with_only_cap_chown_hands_a_host_path_to_the_non_root_user(
    real_node: dict[str, Any],
    kube_cluster: cluster.KubeCluster,
    core: kubernetes.client.CoreV1Api,
    namespace: str,
) -> None:
    # What the chart's node-cache DaemonSet does for the disk tier: this VM's bounding
    # set lacks CAP_SYS_RESOURCE, and this shows CAP_CHOWN alone is enough.
    host_dir = node.Paths.under(cluster.CLUSTER_DIR).root / f"hostpath-{namespace}"
    image = toolbox(real_node)
    mount = {"name": "cache", "mountPath": "/cache"}
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "chown"},
        "spec": {
            "nodeSelector": {node.REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": node.REAL_NODE_LABEL, "operator": "Exists"}],
            "terminationGracePeriodSeconds": 1,
            "initContainers": [
                {
                    "name": "prepare",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "args": ["chown", "65532", "65532", "/cache"],
                    "securityContext": {
                        "runAsUser": 0,
                        "runAsNonRoot": False,
                        "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
                    },
                    "volumeMounts": [mount],
                }
            ],
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "args": ["sleep", "/cache/written"],
                    "securityContext": {
                        "runAsUser": 65532,
                        "runAsGroup": 65532,
                        "runAsNonRoot": True,
                        "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "volumeMounts": [mount],
                }
            ],
            "volumes": [
                {"name": "cache", "hostPath": {"path": str(host_dir), "type": "DirectoryOrCreate"}}
            ],
        },
    }
    core.create_namespaced_pod(namespace, body)
    wait_ready(core, namespace, "chown")

    written = host_dir / "written"
    assert (written.stat().st_uid, written.stat().st_gid) == (65532, 65532)
    assert (host_dir.stat().st_uid, host_dir.stat().st_gid) == (65532, 65532)
    status = kubectl(
        kube_cluster,
        "-n",
        namespace,
        "exec",
        "chown",
        "-c",
        "main",
        "--",
        "/toolbox",
        "cat",
        "/proc/self/status",
    )
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Uid"].split()[:2] == ["65532", "65532"]
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"


def test_a_sub_path_the_kubelet_creates_in_a_setgid_group_writable_host_path_is_writable(
    real_node: dict[str, Any],
    kube_cluster: cluster.KubeCluster,
    core: kubernetes.client.CoreV1Api,
    namespace: str,
) -> None:
    """What the injected sidecar relies on to mount its namespace's directory of the node
    disk tier alone: the kubelet creates a missing subPath directory as root with the
    mode of the volume's root, so in a directory prepared as the chart's DaemonSet does
    (the sidecar's, mode 2770) the new one is root's with the sidecar's group, and the
    non-root container without capabilities writes there; a sibling stays out of sight."""
    uid = 65532
    host_dir = node.Paths.under(cluster.CLUSTER_DIR).root / f"subpath-{namespace}"
    host_dir.mkdir()
    os.chown(host_dir, uid, uid)
    host_dir.chmod(0o2770)
    sibling = host_dir / "ns-other"
    sibling.mkdir()
    (sibling / "entry").write_text("another namespace's\n")
    image = toolbox(real_node)
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "subpath"},
        "spec": {
            "nodeSelector": {node.REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": node.REAL_NODE_LABEL, "operator": "Exists"}],
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "args": ["sleep", "/cache/ns-mine/written"],
                    "securityContext": {
                        "runAsUser": uid,
                        "runAsGroup": uid,
                        "runAsNonRoot": True,
                        "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "volumeMounts": [
                        {"name": "cache", "mountPath": "/cache/ns-mine", "subPath": "ns-mine"}
                    ],
                }
            ],
            "volumes": [
                {"name": "cache", "hostPath": {"path": str(host_dir), "type": "DirectoryOrCreate"}}
            ],
        },
    }
    try:
        core.create_namespaced_pod(namespace, body)
        wait_ready(core, namespace, "subpath")
        made = (host_dir / "ns-mine").stat()
        assert (made.st_uid, made.st_gid, made.st_mode & 0o7777) == (0, uid, 0o2770)
        written = (host_dir / "ns-mine" / "written").stat()
        assert (written.st_uid, written.st_gid) == (uid, uid)
        mounts = kubectl(
            kube_cluster, "-n", namespace, "exec", "subpath", "-c", "main", "--",
            "/toolbox", "cat", "/proc/self/mountinfo",
        )  # fmt: skip
        (mine,) = [line.split() for line in mounts.splitlines() if " /cache/ns-mine " in line]
        # The bind's root within the host filesystem is the namespace's directory alone.
        assert mine[3].endswith(f"/subpath-{namespace}/ns-mine"), mine
    finally:
        with contextlib.suppress(kubernetes.client.ApiException):
            core.delete_namespaced_pod("subpath", namespace, grace_period_seconds=0)


def test_an_image_nobody_imported_fails_on_the_loopback_proxy_without_leaving_the_machine(
    real_node: dict[str, Any], core: kubernetes.client.CoreV1Api, namespace: str
) -> None:
    body = real_node_pod("unimported", "shardcache.test/never-imported:1")
    for container in body["spec"]["initContainers"] + body["spec"]["containers"]:
        container["imagePullPolicy"] = "IfNotPresent"  # so the kubelet does try to pull
    core.create_namespaced_pod(namespace, body)
    deadline = time.monotonic() + POD_READY_TIMEOUT_S
    messages: list[str] = []
    while time.monotonic() < deadline:
        events = core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=unimported,reason=Failed"
        ).items
        messages = [e.message for e in events if "never-imported" in (e.message or "")]
        if messages:
            break
        time.sleep(0.5)
    assert messages, "no failed pull reported"
    # containerd's proxy is a closed loopback port: the pull never reached a network.
    assert f"proxyconnect tcp: dial tcp {node.NO_PULL_PROXY.removeprefix('http://')}" in messages[0]


def test_an_archive_imported_through_the_cli_runs_as_a_pod(
    real_node: dict[str, Any],
    kube_cluster: cluster.KubeCluster,
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    tmp_path: pathlib.Path,
) -> None:
    # The way the product images get onto the node: any OCI archive whose index names
    # its image, through `cluster.py import-image`.
    toolbox_archive = pathlib.Path(real_node["images"][toolbox(real_node)])
    binary = _file_from_archive(toolbox_archive, "toolbox")
    name = f"shardcache.test/imported:{namespace}"
    archive = tmp_path / "imported.tar"
    archive.write_bytes(
        oci.image_archive(
            name,
            [oci.layer([oci.File("bin/tool", binary, 0o755)])],
            oci.Config(entrypoint=("/bin/tool",), cmd=("sleep",)),
        )
    )
    result = run_cluster("import-image", str(archive))
    assert result.returncode == 0, result.stdout + result.stderr
    assert name in result.stdout

    body = real_node_pod("imported", name)
    body["spec"]["initContainers"] = []
    body["spec"]["containers"][0]["args"] = []  # the image's own entrypoint and cmd
    body["spec"]["containers"][0]["volumeMounts"] = []
    core.create_namespaced_pod(namespace, body)
    wait_ready(core, namespace, "imported")
    out = kubectl(
        kube_cluster, "-n", namespace, "exec", "imported", "--", "/bin/tool", "echo", "hi"
    )
    assert out == "hi\n"


def _file_from_archive(archive: pathlib.Path, path: str) -> bytes:
    """One file of the (single) layer of an OCI archive oci.py wrote."""
    with tarfile.open(archive) as outer:
        for member in outer.getmembers():
            if not member.name.startswith("blobs/") or not member.isfile():
                continue
            blob = outer.extractfile(member)
            assert blob is not None
            data = blob.read()
            with contextlib.suppress(tarfile.ReadError):
                with tarfile.open(fileobj=io.BytesIO(data)) as layer:
                    if path in layer.getnames():
                        found = layer.extractfile(path)
                        assert found is not None
                        return found.read()
    raise AssertionError(f"{archive} has no layer holding {path}")


def test_pods_without_the_toleration_stay_on_kwok_nodes(
    real_node: dict[str, Any], core: kubernetes.client.CoreV1Api, namespace: str
) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "elsewhere"},
        "spec": {"containers": [{"name": "c", "image": "not-imported.test/none:1"}]},
    }
    core.create_namespaced_pod(namespace, body)
    deadline = time.monotonic() + POD_READY_TIMEOUT_S
    node_name = None
    while node_name is None and time.monotonic() < deadline:
        node_name = core.read_namespaced_pod("elsewhere", namespace).spec.node_name
        time.sleep(0.2)
    assert node_name is not None, "the pod was never scheduled"
    annotations = core.read_node(node_name).metadata.annotations or {}
    assert annotations.get("kwok.x-k8s.io/node") == "fake", node_name


def run_cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(cluster.CLUSTER_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=cluster.UP_TIMEOUT_S,
        check=False,
    )


def test_up_after_the_node_was_killed_cleans_its_debris_and_comes_back(
    real_node: dict[str, Any], kube_cluster: cluster.KubeCluster
) -> None:
    # Its own clients: the control plane it ends with is a new one (new ports, new CA).
    name = f"node-{os.urandom(3).hex()}"
    namespace = kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name))
    before = kube_cluster.api_client()
    try:
        core = kubernetes.client.CoreV1Api(before)
        core.create_namespace(namespace)
        core.create_namespaced_pod(name, real_node_pod("doomed", toolbox(real_node)))
        wait_ready(core, name, "doomed")
    finally:
        before.close()  # type: ignore[no-untyped-call]
    state = json.loads((cluster.CLUSTER_DIR / "state.json").read_text())
    for component in ("kube-proxy", "kubelet", "containerd"):
        os.kill(int(state["pids"][component]), signal.SIGKILL)
    paths = node.Paths.under(cluster.CLUSTER_DIR)
    debris = node.leftovers(paths)
    # The kill left running containers (their shims), mounts and chains: debris to clean.
    assert debris["shims"] and debris["mounts"] and debris["chains"], debris

    result = run_cluster("up")
    assert result.returncode == 0, result.stdout + result.stderr
    after = kube_cluster.api_client()
    try:
        core = kubernetes.client.CoreV1Api(after)
        core.create_namespace(namespace)
        core.create_namespaced_pod(name, real_node_pod("reborn", toolbox(real_node)))
        wait_ready(core, name, "reborn")
    finally:
        after.close()  # type: ignore[no-untyped-call]


def test_down_leaves_no_containers_mounts_netns_chains_bridge_or_sysctls(
    preexisting_cluster: bool, real_node: dict[str, Any]
) -> None:
    saved = json.loads((node.MACHINE_DIR / "sysctls.json").read_text())
    paths = node.Paths.under(cluster.CLUSTER_DIR)
    assert node.leftovers(paths)["bridge"]  # it was up, with a pod still running

    result = run_cluster("down")
    assert result.returncode == 0, result.stdout + result.stderr

    left = node.leftovers(paths)
    assert not left["bridge"]
    assert left["chains"] == []
    assert left["netns"] == []
    assert left["mounts"] == []
    assert left["cgroups"] == []
    assert left["shims"] == []
    assert not left["sysctls saved"]
    assert node.read_sysctls() == saved
    assert not any(line.split()[0] == network.BRIDGE for line in _ip_links())
    if preexisting_cluster:
        # `make cluster-up` had it up: leave it up again.
        again = run_cluster("up")
        assert again.returncode == 0, again.stdout + again.stderr


def _ip_links() -> list[str]:
    out = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()
