"""A deleted namespace's node disk tier is reclaimed on the real node (node explorer's
defect 2): a tenant namespace fills its `ns-<namespace>.<uid>` through a real pod, is deleted,
and the chart's node-cache DaemonSet (`nodeCache.reclaim`, every
`release.RECLAIM_INTERVAL_S` here) removes the directory and says so in its log, while
the live namespace's directory stays: under `nodeCache.path`, and under another node path
the platform allows (`policy.nodePaths`), which the DaemonSet prepares and reclaims too."""

from __future__ import annotations

import contextlib
import pathlib
import secrets
import shutil

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from shardcache_operator import reclaim_decisions, specs

from tests.e2e import harness
from tests.node.product import jobs, pods, release
from tests.support import s3server

pytestmark = [pytest.mark.node, pytest.mark.timeout(900)]

#: Rounds the reclaim gets after the namespace is gone: the first may find the last
#: sidecar's locks still held, a round takes a moment of its own.
ROUNDS = 4


@pytest.fixture(scope="module")
def core(admin: kubernetes.client.ApiClient) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(admin)


def _reclaim_logs(core: kubernetes.client.CoreV1Api) -> str:
    found = core.list_namespaced_pod(
        release.RELEASE_NAMESPACE, label_selector="app.kubernetes.io/component=node-cache"
    )
    return "\n".join(
        pods.log(core, release.RELEASE_NAMESPACE, p.metadata.name, "reclaim") for p in found.items
    )


@pytest.mark.parametrize(
    "node_path", [release.NODE_CACHE_PATH, release.SECOND_NODE_PATH], ids=["default", "second"]
)
def test_a_deleted_namespaces_node_disk_tier_is_reclaimed(
    node_path: pathlib.Path,
    admin: kubernetes.client.ApiClient,
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    operator: harness.InClusterOperator,
    node_store: s3server.S3Server,
    product_images: release.ProductImages,
    real_node: release.RealNode,
) -> None:
    custom = kubernetes.client.CustomObjectsApi(admin)
    live_uid = core.read_namespace(namespace).metadata.uid
    live = node_path / f"ns-{namespace}.{live_uid}"
    live_before = live.is_dir()
    ns = release.tenant_namespace(admin, namespace, "gone-tenant")
    tier = node_path / f"ns-{ns}.{core.read_namespace(ns).metadata.uid}"
    try:
        core.create_namespaced_secret(ns, kubernetes.client.V1Secret(
            metadata={"name": release.SECRET_NAME}, string_data=node_store.env()))  # fmt: skip
        core.create_namespaced_config_map(ns, jobs.trainer_configmap())
        release.make_mount(
            admin, operator, node_store, ns, "train", release.TRAIN_SHARDS,
            sharding={"seed": release.TRAIN_SEED, "worldSize": 1, "blockSize": release.TRAIN_BLOCK_SIZE},
            sidecar=release.small_sidecar(), cache={"nodePath": str(node_path)},
        )  # fmt: skip
        name = f"reader-{secrets.token_hex(3)}"
        core.create_namespaced_pod(ns, jobs.single_pod(
            name, "train", product_images.trainer, settings=release.trainer_settings(),
            node_selector=real_node.node_selector, tolerations=real_node.tolerations))  # fmt: skip
        pods.wait_pod(core, ns, name, lambda p: p.status.phase == "Succeeded", "done")
        held = sum(p.stat().st_size for p in tier.iterdir() if p.is_file())
        assert held > 0, f"{tier} holds nothing after a pod read through it"
        custom.patch_namespaced_custom_object(specs.GROUP, specs.VERSION, ns, specs.PLURAL, "train", {
            "metadata": {"annotations": {specs.ANNOTATION_FORCE_DELETE: "true"}}})  # fmt: skip
        core.delete_namespace(ns)

        def ns_gone() -> bool:
            try:
                core.read_namespace(ns)
            except ApiException as exc:
                return exc.status == 404
            return False

        harness.wait_until(f"namespace {ns} deleted", ns_gone, timeout=180, interval=2)
        harness.wait_until(
            f"the node-cache DaemonSet to reclaim {tier}",
            lambda: not tier.exists(),
            timeout=ROUNDS * release.RECLAIM_INTERVAL_S + 30,
            interval=1,
        )
        assert not [p for p in node_path.iterdir() if p.name.startswith(".reclaiming-")]
        if live_before:
            assert live.is_dir(), f"{live} of the live namespace {namespace} was removed"
        logs = _reclaim_logs(core)
        assert f"(deleted namespace {ns})" in logs, logs
        # The node's path, as its admin knows it, not the container's mount point.
        assert f"removed {node_path}/{reclaim_decisions.ASIDE_PREFIX}{ns}-" in logs, logs
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespace(ns)
        shutil.rmtree(tier, ignore_errors=True)
