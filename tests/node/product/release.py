"""The product's release on the real node, as values and small records the fixtures
(conftest.py) and the tests share: the chart's in-cluster values, the real node, the
imported images, the DatasetMounts the tests read.
"""

from __future__ import annotations

import dataclasses
import pathlib
import secrets
from collections.abc import Callable
from typing import Any

import kubernetes.client

from tests.e2e import harness, objects
from tests.support import datasets, s3server

RELEASE = "shardcache"
RELEASE_NAMESPACE = "shardcache-system"
OPERATOR_DEPLOYMENT = f"{RELEASE}-operator"
NODE_CACHE_DAEMONSET = f"{RELEASE}-node-cache"
#: The chart's default node disk tier (values nodeCache.path), prepared by its DaemonSet.
NODE_CACHE_PATH = pathlib.Path("/var/cache/shardcache")
#: A second node path the platform allows (values policy.nodePaths): the DaemonSet
#: prepares and reclaims it too (test_node_reclaim.py reads through both).
SECOND_NODE_PATH = pathlib.Path("/var/cache/shardcache-second")
SECRET_NAME = objects.SECRET_NAME
#: Pods here start a sandbox, pull nothing, run Python: seconds each on an idle machine;
#: two shared cores make it tens of seconds.
ROLLOUT_TIMEOUT_S = 300.0
GONE_TIMEOUT_S = 240.0
#: The dataset of the Job tests: six Parquet shards of uneven sizes, 200 rows.
TRAIN_SHARDS = (40, 25, 31, 52, 17, 35)
TRAIN_SEED = 11
TRAIN_BLOCK_SIZE = 8
#: The operator's look for skips the sidecars applied (check-skips; the chart leaves it
#: at the settings' default minute, set here through operator.extraEnv): test_skip.py
#: waits for status.lastSkip, and a few seconds keep that wait short.
SKIPS_INTERVAL_S = 3
#: The node-cache DaemonSet's reclaim interval (nodeCache.reclaim.intervalSeconds;
#: 600 by default): short, so that test_node_reclaim sees a deleted namespace's tier go.
RECLAIM_INTERVAL_S = 10
CRD_NAMES = (
    "datasetmounts.shardcache.io",
    "clusterkopfpeerings.kopf.dev",
    "kopfpeerings.kopf.dev",
)


@dataclasses.dataclass(frozen=True)
class RealNode:
    """The cluster's one real node, as tests/cluster/cluster.py recorded it."""

    name: str
    label: str
    host_address: str
    containerd_socket: pathlib.Path

    @property
    def node_selector(self) -> dict[str, str]:
        return {self.label: "true"}

    @property
    def tolerations(self) -> list[dict[str, str]]:
        return [{"key": self.label, "operator": "Exists", "effect": "NoSchedule"}]


@dataclasses.dataclass(frozen=True)
class ProductImages:
    shardcache: str
    trainer: str
    sizes: dict[str, int]

    @staticmethod
    def split(reference: str) -> tuple[str, str]:
        repository, _, tag = reference.rpartition(":")
        return repository, tag


#: The chart's operator replicas in this tier (two: kopf peering between them).
OPERATOR_REPLICAS = 2


def wait_for_operator_replicas(
    apps: kubernetes.client.AppsV1Api, what: str, describe: Callable[[], str] | None = None
) -> None:
    """Until every operator replica is Ready (`what` names the moment, for the time-out)."""
    harness.wait_until(
        what,
        lambda: (
            apps.read_namespaced_deployment_status(
                OPERATOR_DEPLOYMENT, RELEASE_NAMESPACE
            ).status.ready_replicas
            == OPERATOR_REPLICAS
        ),
        timeout=ROLLOUT_TIMEOUT_S,
        interval=2,
        describe=describe,
    )


def release_values(
    product_images: ProductImages, real_node: RealNode, namespace: str
) -> dict[str, Any]:
    """In-cluster mode: the chart's Deployment and Service, the chart-generated CA; the
    images as built and imported (never pulled); everything steered to the real node."""
    repository, tag = ProductImages.split(product_images.shardcache)
    return {
        "operator": {
            "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
            "replicas": OPERATOR_REPLICAS,
            "settings": dict(harness.OPERATOR_SETTINGS),
            "resources": {"requests": {"cpu": "20m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
            "nodeSelector": real_node.node_selector,
            "tolerations": real_node.tolerations,
            "extraEnv": [{"name": "SHARDCACHE_OPERATOR_SKIPS_INTERVAL_SECONDS",
                          "value": str(SKIPS_INTERVAL_S)}],
        },
        "sidecar": {"image": {"repository": repository, "tag": tag}},
        # `default`: where examples/ put their DatasetMounts and Secret (test_examples.py).
        "rbac": {"secretNamespaces": [namespace, "default"], "secretNames": [SECRET_NAME],
                 "manifestNamespaces": [namespace]},
        "policy": {"nodePaths": [str(NODE_CACHE_PATH), str(SECOND_NODE_PATH)]},
        "nodeCache": {"nodeSelector": real_node.node_selector,
                      "reclaim": {"intervalSeconds": RECLAIM_INTERVAL_S}},
    }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Mount:
    """A Ready DatasetMount on known rows."""

    name: str
    namespace: str
    total_rows: int
    status: dict[str, Any]
    bucket: str


def make_mount(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    store: s3server.S3Server,
    namespace: str,
    name: str,
    shard_rows: tuple[int, ...],
    **spec: Any,
) -> Mount:
    bucket = store.make_bucket("node")
    datasets.write_dataset(store.filesystem(), f"{bucket}/data", shard_rows)
    body = objects.datasetmount(name, f"s3://{bucket}/data/", **spec)
    objects.create_datasetmount(admin, namespace, body)
    status = objects.wait_phase(admin, namespace, name, "Ready", operator)
    return Mount(name, namespace, sum(shard_rows), status, bucket)


def tenant_namespace(admin: kubernetes.client.ApiClient, like: str, prefix: str) -> str:
    """A new namespace `<prefix>-<hex>` whose Secret `SECRET_NAME` the operator may
    read: the chart's secret-reader Role and binding of namespace `like` copied into
    it, as `rbac.secretNamespaces` would make them. The caller deletes it."""
    core = kubernetes.client.CoreV1Api(admin)
    rbac = kubernetes.client.RbacAuthorizationV1Api(admin)
    name = f"{prefix}-{secrets.token_hex(3)}"
    core.create_namespace(kubernetes.client.V1Namespace(metadata={"name": name}))
    harness.wait_until(
        f"the default ServiceAccount of {name}",
        lambda: core.read_namespaced_service_account("default", name),
        timeout=60,
    )
    for role in rbac.list_namespaced_role(like).items:
        rbac.create_namespaced_role(
            name, {"metadata": {"name": role.metadata.name}, "rules": role.rules}
        )
    for binding in rbac.list_namespaced_role_binding(like).items:
        rbac.create_namespaced_role_binding(name, {
            "metadata": {"name": binding.metadata.name},
            "roleRef": binding.role_ref, "subjects": binding.subjects})  # fmt: skip
    return name


def small_sidecar() -> dict[str, Any]:
    # Two cores shared by every pod of the node: requests small enough that a Job's
    # ranks and the operator's replicas all fit at once.
    return {"resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                          "limits": {"memory": "512Mi"}}}  # fmt: skip


def trainer_settings(**extra: object) -> dict[str, object]:
    """The trainer's TRAINER_* env for the `train` mount, plus `extra`."""
    return {"TRAINER_SEED": TRAIN_SEED, "TRAINER_BATCH_SIZE": 8, **extra}
