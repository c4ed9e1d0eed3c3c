"""A key rotated in the Secret reaches a running pod's sidecar through the real kubelet.

The rotation as a platform does it: the new key goes into the Secret first; once the
kubelet has updated the Secret volume the webhook mounted in the sidecar
(`SHARDCACHE_CREDENTIALS_DIR`), the old key is revoked (the test's own MinIO restarted
with the new root key). The trainer, mid-epoch, reads on: its next cold shard is
refused with the old key, the sidecar reads the files again and fetches it with the new
one (`shardcache.source_credentials`), and the epoch is exact. The sidecar's env, which
never changes in a running container, still holds the old key.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from shardcache_operator import specs

from shardcache import contract
from tests.e2e import harness
from tests.node.product import jobs, pods, release
from tests.support import s3server

pytestmark = [pytest.mark.node, pytest.mark.timeout(900)]

#: Seconds the trainer pauses after each batch: its 25 batches outlast the rotation
#: (the kubelet's Secret refresh, about its 10 s sync period here, and a MinIO restart).
STEP_S = 2.5

READ_KEY = """
import pathlib
print(pathlib.Path("/etc/shardcache/credentials/AWS_ACCESS_KEY_ID").read_text())
"""


@pytest.fixture
def rotating_store(real_node: release.RealNode) -> Iterator[s3server.S3Server]:
    """A MinIO of this test's own on the bridge: its root key is rotated."""
    with s3server.own_server("shardcache-node-rotated-", host=real_node.host_address) as server:
        yield server


def test_a_key_rotated_in_the_secret_reaches_the_running_sidecar(
    admin: kubernetes.client.ApiClient,
    node_cluster: harness.Cluster,
    operator: harness.InClusterOperator,
    namespace: str,
    rotating_store: s3server.S3Server,
    product_images: release.ProductImages,
    real_node: release.RealNode,
) -> None:
    core = kubernetes.client.CoreV1Api(admin)
    ns = release.tenant_namespace(admin, namespace, "rotating")
    try:
        old_key = rotating_store.access_key
        core.create_namespaced_secret(ns, kubernetes.client.V1Secret(
            metadata={"name": release.SECRET_NAME}, string_data=rotating_store.env()))  # fmt: skip
        core.create_namespaced_config_map(ns, jobs.trainer_configmap())
        mount = release.make_mount(
            admin, operator, rotating_store, ns, "train", release.TRAIN_SHARDS,
            sharding={"seed": release.TRAIN_SEED, "worldSize": 1, "blockSize": release.TRAIN_BLOCK_SIZE},
            sidecar=release.small_sidecar(),
            # Each shard fetched when the trainer reaches it, not ahead: most of them
            # after the rotation.
            prefetch={"depth": 0, "readyShards": 0},
        )  # fmt: skip
        name = f"reader-{secrets.token_hex(3)}"
        core.create_namespaced_pod(ns, jobs.single_pod(
            name, "train", product_images.trainer,
            settings=release.trainer_settings(TRAINER_STEP_SECONDS=STEP_S),
            node_selector=real_node.node_selector, tolerations=real_node.tolerations))  # fmt: skip
        pods.wait_event(core, ns, name, lambda e: e["event"] == "progress", "its first batch")
        sidecar = pods.sidecar_status(core.read_namespaced_pod(name, ns)).name

        new_key = "rotated-" + secrets.token_hex(4)
        new_secret = secrets.token_urlsafe(24)
        core.patch_namespaced_secret(release.SECRET_NAME, ns, {"stringData": {
            contract.ENV_S3_ACCESS_KEY_ID: new_key,
            contract.ENV_S3_SECRET_ACCESS_KEY: new_secret}})  # fmt: skip
        harness.wait_until(
            "the kubelet to update the Secret's files in the running sidecar",
            lambda: pods.exec_python(node_cluster, ns, name, sidecar, READ_KEY).strip() == new_key,
            timeout=120,
            interval=1,
        )
        # The env, fixed at the container's start, still holds the old key.
        env = pods.exec_python(node_cluster, ns, name, sidecar,
                               "import os; print(os.environ['AWS_ACCESS_KEY_ID'])")  # fmt: skip
        assert env.strip() == old_key
        rotating_store.stop()
        rotating_store.access_key, rotating_store.secret_key = new_key, new_secret
        rotating_store.start()

        pods.wait_event(core, ns, name, lambda e: e["event"] == "done", "its epoch done")
        done = jobs.event(pods.log(core, ns, name, jobs.TRAINER_CONTAINER), "done")
        assert jobs.Totals.reported(done) == jobs.Totals.of(list(range(mount.total_rows)))
        log = pods.log(core, ns, name, sidecar)
        assert "the store refused the credentials in use" in log, log[-4000:]
        assert "using the ones now in /etc/shardcache/credentials" in log, log[-4000:]
    finally:
        with contextlib.suppress(ApiException):
            kubernetes.client.CustomObjectsApi(admin).patch_namespaced_custom_object(
                specs.GROUP, specs.VERSION, ns, specs.PLURAL, "train",
                {"metadata": {"annotations": {specs.ANNOTATION_FORCE_DELETE: "true"}}})  # fmt: skip
        with contextlib.suppress(ApiException):
            core.delete_namespace(ns)
