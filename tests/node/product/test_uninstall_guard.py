"""`helm uninstall` while a DatasetMount exists, on the real node: the chart's pre-delete
hook Job runs the guard from the built image, helm stops before deleting anything, the
Job's pod says which mount and what to do, and the rollback the refusal names makes the
release deployed again. (The uninstall that goes on, no mount left, is the release
fixture's own teardown, which fails the tier if the guard refuses it: conftest.py.)"""

from __future__ import annotations

import json

import kubernetes.client
import pytest
from shardcache_operator import specs

from tests.e2e import harness, objects
from tests.node.product import pods, release

pytestmark = [pytest.mark.node, pytest.mark.timeout(600)]

GUARD_SELECTOR = "app.kubernetes.io/component=uninstall-guard"


def helm_status(node_cluster: harness.Cluster) -> dict[str, object]:
    shown = node_cluster.run(
        "helm", "status", release.RELEASE, "-n", release.RELEASE_NAMESPACE, "-o", "json"
    )
    return dict(json.loads(shown.stdout))


def test_uninstall_is_refused_while_a_datasetmount_exists_and_the_release_kept(
    node_cluster: harness.Cluster,
    admin: kubernetes.client.ApiClient,
    operator: harness.InClusterOperator,
    train_mount: release.Mount,
) -> None:
    core = kubernetes.client.CoreV1Api(admin)
    apps = kubernetes.client.AppsV1Api(admin)
    revision = helm_status(node_cluster)["version"]
    refused = node_cluster.run(
        "helm", "uninstall", release.RELEASE, "-n", release.RELEASE_NAMESPACE,
        "--timeout=4m", check=False,
    )  # fmt: skip
    assert refused.returncode != 0, refused.stdout
    assert "job shardcache-uninstall-guard failed" in refused.stderr, refused.stderr

    # The Job's pod ran the guard on the real node and said why, in its termination
    # message (what `kubectl get pod -o yaml` shows) as in its log.
    (pod,) = core.list_namespaced_pod(
        release.RELEASE_NAMESPACE, label_selector=GUARD_SELECTOR
    ).items
    (status,) = pod.status.container_statuses
    terminated = status.state.terminated
    assert terminated is not None and terminated.exit_code == 1, status
    message = terminated.message or ""
    custom = kubernetes.client.CustomObjectsApi(admin)
    existing = sorted(
        f"{m['metadata']['namespace']}/{m['metadata']['name']}"
        for m in custom.list_cluster_custom_object(specs.GROUP, specs.VERSION, specs.PLURAL)[
            "items"
        ]
    )
    assert f"{train_mount.namespace}/{train_mount.name}" in existing
    count = f"{len(existing)} DatasetMount" + (
        "s still exist," if len(existing) > 1 else " still exists,"
    )
    assert message.startswith(f"helm uninstall refused: {count}"), message
    named = [line.strip().split(" (")[0] for line in message.splitlines() if line.startswith("  ")]
    assert named[: len(existing)] == existing, message
    assert f"  {train_mount.namespace}/{train_mount.name} (Ready" in message, message
    assert f"helm rollback {release.RELEASE} {revision} -n {release.RELEASE_NAMESPACE}" in message
    log = core.read_namespaced_pod_log(pod.metadata.name, release.RELEASE_NAMESPACE)
    assert message.splitlines()[0] in log

    # Nothing was deleted: the operator runs, the webhook is there, the mount untouched.
    deployment = apps.read_namespaced_deployment_status(
        release.OPERATOR_DEPLOYMENT, release.RELEASE_NAMESPACE
    )
    assert deployment.status.ready_replicas == release.OPERATOR_REPLICAS, pods.describe(
        core, release.RELEASE_NAMESPACE
    )
    admission = kubernetes.client.AdmissionregistrationV1Api(admin)
    assert [
        w.metadata.name
        for w in admission.list_mutating_webhook_configuration().items
        if w.metadata.name.startswith(release.RELEASE)
    ], "the webhook configuration was deleted"
    mount = objects.get_datasetmount(admin, train_mount.namespace, train_mount.name)
    assert "deletionTimestamp" not in mount["metadata"]
    assert mount["status"]["phase"] == "Ready"

    # helm's own record says `uninstalling` (a failed pre-delete hook leaves it so); the
    # rollback the refusal names makes it deployed again, as a new revision.
    assert helm_status(node_cluster)["info"]["status"] == "uninstalling"  # type: ignore[index]
    node_cluster.run(
        "helm", "rollback", release.RELEASE, str(revision), "-n", release.RELEASE_NAMESPACE
    )
    after = helm_status(node_cluster)
    assert after["info"]["status"] == "deployed", after["info"]  # type: ignore[index]
    assert after["version"] == int(str(revision)) + 1
    release.wait_for_operator_replicas(
        apps,
        "both operator replicas Ready after the rollback",
        describe=lambda: pods.describe(core, release.RELEASE_NAMESPACE),
    )
