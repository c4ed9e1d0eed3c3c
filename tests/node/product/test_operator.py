"""The operator as the chart deploys it, running on the real node: two replicas that
peer through the chart's ClusterKopfPeering, and the webhook reached through the
chart's Service with the chart-generated CA, not an external URL.
"""

from __future__ import annotations

import base64

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException

from tests.e2e import harness, objects
from tests.node.product import pods, release

# Fixture set-up (images, the release, a Ready mount) counts towards the first test.
pytestmark = [pytest.mark.node, pytest.mark.timeout(900)]


def test_two_operator_replicas_run_on_the_real_node_from_the_built_image(
    admin: kubernetes.client.ApiClient,
    operator: harness.InClusterOperator,
    product_images: release.ProductImages,
    real_node: release.RealNode,
) -> None:
    core = kubernetes.client.CoreV1Api(admin)
    listing = core.list_namespaced_pod(
        release.RELEASE_NAMESPACE, label_selector="app.kubernetes.io/name=shardcache"
    )
    operators = [
        p for p in listing.items if p.metadata.name.startswith(release.OPERATOR_DEPLOYMENT)
    ]
    assert len(operators) == 2, pods.describe(core, release.RELEASE_NAMESPACE)
    for pod in operators:
        assert pod.spec.node_name == real_node.name
        (status,) = pod.status.container_statuses
        assert status.ready and status.restart_count == 0, status
        assert pod.spec.containers[0].image == product_images.shardcache
        # containerd reports one of the names the imported image carries (its version tag).
        repository, _ = release.ProductImages.split(product_images.shardcache)
        assert status.image.startswith(f"{repository}:"), status.image


def test_the_replicas_peer_through_the_charts_clusterkopfpeering(
    admin: kubernetes.client.ApiClient, operator: harness.InClusterOperator
) -> None:
    custom = kubernetes.client.CustomObjectsApi(admin)

    def peers() -> dict[str, object] | None:
        obj = custom.get_cluster_custom_object(
            "kopf.dev", "v1", "clusterkopfpeerings", "shardcache"
        )
        found = dict(obj.get("status") or {})
        return found if len(found) == 2 else None

    # kopf writes each peer's heartbeat into the peering object's status.
    seen = harness.wait_until("two peers in the ClusterKopfPeering", peers, timeout=120)
    assert len(seen) == 2, seen


def test_the_webhook_is_called_through_the_charts_service_and_ca(
    admin: kubernetes.client.ApiClient, operator: harness.InClusterOperator, namespace: str
) -> None:
    registration = kubernetes.client.AdmissionregistrationV1Api(admin)
    (hook,) = registration.read_mutating_webhook_configuration(release.RELEASE).webhooks
    client = hook.client_config
    assert client.url is None
    assert client.service.namespace == release.RELEASE_NAMESPACE
    assert client.service.path == "/shardcache-inject"
    secret = kubernetes.client.CoreV1Api(admin).read_namespaced_secret(
        f"{release.RELEASE}-webhook-tls", release.RELEASE_NAMESPACE
    )
    assert base64.b64decode(client.ca_bundle) == base64.b64decode(secret.data["ca.crt"])
    # And it answers there: the API server reached the operator pods through the
    # Service's ClusterIP (kube-proxy) and trusted their certificate by that caBundle.
    probe = objects.pod("webhook-probe", "no-such-mount")
    with pytest.raises(ApiException) as refused:
        kubernetes.client.CoreV1Api(admin).create_namespaced_pod(namespace, probe, dry_run="All")
    body = str(refused.value.body)
    assert "no-such-mount" in body and "failed calling webhook" not in body, body
