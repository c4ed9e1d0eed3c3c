"""Fixtures of the product on the real node: the chart installed with the operator IN the
cluster, the project's images imported, MinIO on the bridge, a Ready DatasetMount.

Package-scoped, so all of it is torn down (namespaces emptied and deleted, the release
uninstalled, the CRDs and the node's disk-tier directory removed) before the node tier's
own last tests stop the node (tests/node/test_node.py sorts after this package).

What differs from the e2e tier (tests/e2e): nothing runs on this machine but the test;
the operator is the chart's Deployment (two replicas, kopf peering), the API server
calls the webhook through the chart's Service and generated CA, and every container is
one of the images built from images/image.toml, imported into the node's containerd.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from shardcache_operator import specs

from images import build
from tests.cluster import images
from tests.e2e import harness, objects
from tests.node.product import jobs, pods, release
from tests.support import cluster, s3server

#: The order the modules run in: the operator first (everything else needs it), the
#: Job, then faults, skips and limits, the examples (they cordon kwok's nodes), and the
#: refused uninstall last (it leaves a new revision of the release).
MODULE_ORDER = (
    "test_operator", "test_job", "test_faults", "test_skip", "test_limits", "test_examples",
    "test_uninstall_guard",
)  # fmt: skip
PRODUCT_DIR = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slots = [i for i, item in enumerate(items) if PRODUCT_DIR in item.path.parents]
    ours = [items[i] for i in slots]

    def rank(item: pytest.Item) -> int:
        stem = item.path.stem
        return MODULE_ORDER.index(stem) if stem in MODULE_ORDER else len(MODULE_ORDER)

    for slot, item in zip(slots, sorted(ours, key=rank), strict=True):
        items[slot] = item


@pytest.fixture(scope="package")
def real_node(kube_cluster: cluster.KubeCluster) -> release.RealNode:
    state = json.loads((cluster.CLUSTER_DIR / "state.json").read_text())
    info = state.get("node")
    if not info:
        pytest.fail(
            "the cluster is up without its real node (SHARDCACHE_NODE=0?); the product "
            "tests need it: `make cluster-down`, then run again",
            pytrace=False,
        )
    return release.RealNode(
        name=str(info["name"]),
        label=str(info["label"]),
        host_address=str(info["host_address"]),
        containerd_socket=pathlib.Path(info["containerd_socket"]),
    )


@pytest.fixture(scope="package")
def node_cluster(kube_cluster: cluster.KubeCluster) -> harness.Cluster:
    """The same cluster, with the e2e tier's helpers (helm/kubectl runs, waits)."""
    return harness.Cluster(
        "local",
        kube_cluster.kubeconfig,
        kube_cluster.helm,
        kube_cluster.kubectl,
        kube_cluster.server,
        kube_cluster.ca_file,
    )


@pytest.fixture(scope="package")
def admin(node_cluster: harness.Cluster) -> Iterator[kubernetes.client.ApiClient]:
    client = node_cluster.api_client()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="package")
def product_images(real_node: release.RealNode) -> release.ProductImages:
    """images/image.toml built into OCI archives (cached by content) and imported."""
    archives = build.archives()
    for archive in archives.values():
        if not images.image_present(archive.reference, address=real_node.containerd_socket):
            images.import_image(archive.path, address=real_node.containerd_socket)
    return release.ProductImages(
        shardcache=archives["shardcache"].reference,
        trainer=archives["trainer"].reference,
        sizes={name: a.size_bytes for name, a in archives.items()},
    )


@pytest.fixture(scope="package")
def node_store(real_node: release.RealNode) -> Iterator[s3server.S3Server]:
    """MinIO on the bridge's host address: the operator and the sidecars reach it from
    their pods, the test from here. Never on any other non-loopback address."""
    with s3server.own_server("shardcache-node-minio-", host=real_node.host_address) as server:
        yield server


@pytest.fixture(scope="package")
def namespace_name(admin: kubernetes.client.ApiClient) -> Iterator[str]:
    """The workload namespace, created before the release (the chart's Secret-reading
    Role goes into it); `namespace` below fills it and deletes it before the release goes."""
    name = f"node-product-{secrets.token_hex(3)}"
    core = kubernetes.client.CoreV1Api(admin)
    core.create_namespace(kubernetes.client.V1Namespace(metadata={"name": name}))
    harness.wait_until(
        f"the default ServiceAccount of {name}",
        lambda: core.read_namespaced_service_account("default", name),
        timeout=60,
    )
    try:
        yield name
    finally:
        # Normally `namespace` deleted it already; not when the release failed to start.
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)


def _entries(directory: pathlib.Path) -> set[str] | None:
    try:
        return {p.name for p in directory.iterdir()}
    except FileNotFoundError:
        return None


def _absent(read: Any) -> bool:
    try:
        read()
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


@pytest.fixture(scope="package")
def operator(
    node_cluster: harness.Cluster,
    admin: kubernetes.client.ApiClient,
    product_images: release.ProductImages,
    real_node: release.RealNode,
    namespace_name: str,
) -> Iterator[harness.InClusterOperator]:
    """`helm install` in-cluster mode; yields the running operator Deployment."""
    values = release.release_values(product_images, real_node, namespace_name)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="shardcache-node-release-"))
    values_file = workdir / "values.json"
    values_file.write_text(json.dumps(values, indent=2))
    cache_before = _entries(release.NODE_CACHE_PATH)
    second_before = release.SECOND_NODE_PATH.exists()
    core = kubernetes.client.CoreV1Api(admin)
    in_cluster = harness.InClusterOperator(
        node_cluster, release.OPERATOR_DEPLOYMENT, release.RELEASE_NAMESPACE
    )
    apps = kubernetes.client.AppsV1Api(admin)
    # What an interrupted earlier session on a reused cluster left must go first.
    if harness.uninstall_leftover_release(node_cluster, release.RELEASE, release.RELEASE_NAMESPACE):
        with contextlib.suppress(ApiException):
            core.delete_namespace(release.RELEASE_NAMESPACE)
    harness.wait_until(
        f"namespace {release.RELEASE_NAMESPACE} gone or not terminating",
        lambda: (
            _absent(lambda: core.read_namespace(release.RELEASE_NAMESPACE))
            or core.read_namespace(release.RELEASE_NAMESPACE).metadata.deletion_timestamp is None
        ),
        timeout=release.GONE_TIMEOUT_S,
    )
    installed = False
    try:
        # No `helm --wait`: a cold start on two busy cores can outlast one helm call's
        # time-out here; the waits below are bounded and say what they saw.
        node_cluster.run(
            "helm", "install", release.RELEASE, str(harness.CHART_DIR),
            "-n", release.RELEASE_NAMESPACE, "--create-namespace", "-f", str(values_file),
        )  # fmt: skip
        installed = True
        release.wait_for_operator_replicas(
            apps,
            "both operator replicas Ready on the real node",
            describe=lambda: (
                pods.describe(core, release.RELEASE_NAMESPACE) + "\n" + in_cluster.logs()
            ),
        )
        harness.wait_until(
            "the node-cache DaemonSet Ready",
            lambda: (
                apps.read_namespaced_daemon_set_status(
                    release.NODE_CACHE_DAEMONSET, release.RELEASE_NAMESPACE
                ).status.number_ready
                == 1
            ),
            timeout=release.ROLLOUT_TIMEOUT_S,
            interval=2,
            describe=lambda: pods.describe(core, release.RELEASE_NAMESPACE),
        )
        yield in_cluster
    finally:
        # The uninstall guard (a pre-delete hook Job on the real node) must let it go on:
        # by now every namespace that held DatasetMounts was emptied. A refusal fails the
        # tier, after the clean-up (without hooks) that leaves the machine as it was.
        custom = kubernetes.client.CustomObjectsApi(admin)
        with contextlib.suppress(AssertionError):
            harness.wait_until(
                "no DatasetMount left before the uninstall",
                lambda: (
                    not custom.list_cluster_custom_object(
                        specs.GROUP, specs.VERSION, specs.PLURAL
                    ).get("items")
                ),
                timeout=release.GONE_TIMEOUT_S,
            )
        uninstalled = node_cluster.run(
            "helm", "uninstall", release.RELEASE, "-n", release.RELEASE_NAMESPACE, check=False
        )
        if uninstalled.returncode != 0:
            node_cluster.run(
                "helm", "uninstall", release.RELEASE, "-n", release.RELEASE_NAMESPACE,
                "--no-hooks", check=False,
            )  # fmt: skip
        ext = kubernetes.client.ApiextensionsV1Api(admin)
        for name in release.CRD_NAMES:
            with contextlib.suppress(ApiException):
                ext.delete_custom_resource_definition(name)
        with contextlib.suppress(ApiException):
            core.delete_namespace(release.RELEASE_NAMESPACE)
        harness.wait_until(
            f"namespace {release.RELEASE_NAMESPACE} to be deleted",
            lambda: _absent(lambda: core.read_namespace(release.RELEASE_NAMESPACE)),
            timeout=release.GONE_TIMEOUT_S,
        )
        # The host keeps nothing of the tests: the directory the DaemonSet made, or (when
        # it was there before) the disk-tier entries this session added to it.
        if cache_before is None:
            shutil.rmtree(release.NODE_CACHE_PATH, ignore_errors=True)
        else:
            for name in (_entries(release.NODE_CACHE_PATH) or set()) - cache_before:
                path = release.NODE_CACHE_PATH / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        if not second_before:  # the DaemonSet's hostPath (DirectoryOrCreate) made it
            shutil.rmtree(release.SECOND_NODE_PATH, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
        assert uninstalled.returncode == 0 or not installed, (
            "helm uninstall with no DatasetMount left was refused:\n"
            + uninstalled.stdout[-2000:]
            + uninstalled.stderr[-2000:]
        )


def _webhook_answers(admin: kubernetes.client.ApiClient, namespace: str) -> bool:
    """A server-side dry run of an opted-in pod for a mount that does not exist: the
    webhook refuses it by name once the API server reaches it through the Service."""
    probe = objects.pod("webhook-probe", "no-such-mount")
    try:
        kubernetes.client.CoreV1Api(admin).create_namespaced_pod(namespace, probe, dry_run="All")
    except ApiException as exc:
        body = str(exc.body or "")
        return "no-such-mount" in body and "failed calling webhook" not in body
    raise AssertionError("a pod for a missing DatasetMount was admitted (policy Refuse)")


@pytest.fixture(scope="package")
def namespace(
    admin: kubernetes.client.ApiClient,
    operator: harness.InClusterOperator,
    namespace_name: str,
    node_store: s3server.S3Server,
) -> Iterator[str]:
    """The workload namespace: the object store's Secret, the trainer program. Deleted
    (pods terminated on the node, DatasetMounts released) before the release goes."""
    core = kubernetes.client.CoreV1Api(admin)
    core.create_namespaced_secret(
        namespace_name,
        kubernetes.client.V1Secret(
            metadata={"name": release.SECRET_NAME},
            string_data=node_store.env(),
        ),
    )
    core.create_namespaced_config_map(namespace_name, jobs.trainer_configmap())
    harness.wait_until(
        "the webhook to answer through the chart's Service",
        lambda: _webhook_answers(admin, namespace_name),
        timeout=release.ROLLOUT_TIMEOUT_S,
        interval=2,
        describe=operator.logs,
    )
    try:
        yield namespace_name
    finally:
        _empty_namespace(admin, namespace_name)


def _empty_namespace(admin: kubernetes.client.ApiClient, namespace: str) -> None:
    custom = kubernetes.client.CustomObjectsApi(admin)
    group, version, plural = specs.GROUP, specs.VERSION, specs.PLURAL
    listing = custom.list_namespaced_custom_object(group, version, namespace, plural)
    for obj in listing.get("items", []):
        name = obj["metadata"]["name"]
        patch = {"metadata": {"annotations": {specs.ANNOTATION_FORCE_DELETE: "true"}}}
        with contextlib.suppress(ApiException):
            custom.patch_namespaced_custom_object(group, version, namespace, plural, name, patch)
    core = kubernetes.client.CoreV1Api(admin)
    core.delete_namespace(namespace, body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0))
    try:
        harness.wait_until(
            f"namespace {namespace} to be deleted",
            lambda: _absent(lambda: core.read_namespace(namespace)),
            timeout=release.GONE_TIMEOUT_S,
        )
    finally:
        # Whatever the operator did not release in time must not block the CRD's deletion.
        for obj in custom.list_namespaced_custom_object(group, version, namespace, plural).get(
            "items", []
        ):
            with contextlib.suppress(ApiException):
                custom.patch_namespaced_custom_object(
                    group, version, namespace, plural, obj["metadata"]["name"],
                    {"metadata": {"finalizers": []}},
                )  # fmt: skip


@pytest.fixture(scope="package")
def train_mount(
    admin: kubernetes.client.ApiClient,
    operator: harness.InClusterOperator,
    node_store: s3server.S3Server,
    namespace: str,
) -> release.Mount:
    """`train`: 200 rows in six shards, two ranks from the Indexed Job's index."""
    return release.make_mount(
        admin, operator, node_store, namespace, "train", release.TRAIN_SHARDS,
        cache={"memory": "64Mi"},
        sharding={"seed": release.TRAIN_SEED, "worldSize": 2, "blockSize": release.TRAIN_BLOCK_SIZE,
                  "rankFrom": "JobCompletionIndex"},
        sidecar=release.small_sidecar(),
    )  # fmt: skip
