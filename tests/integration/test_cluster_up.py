"""The control plane `make cluster-up` starts is real: version, RBAC, tokens, Jobs."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException

from tests.support import cluster, toolpaths

pytestmark = pytest.mark.e2e

POD_RUNNING_TIMEOUT_S = 120.0


@pytest.fixture
def admin(kube_cluster: cluster.KubeCluster) -> Iterator[kubernetes.client.ApiClient]:
    client = kube_cluster.api_client()
    try:
        yield client
    finally:
        client.close()  # type: ignore[no-untyped-call]


@pytest.fixture
def namespace(admin: kubernetes.client.ApiClient) -> Iterator[str]:
    name = f"test-{secrets.token_hex(4)}"
    core = kubernetes.client.CoreV1Api(admin)
    core.create_namespace(
        kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name))
    )
    try:
        yield name
    finally:
        core.delete_namespace(name)


def test_api_server_reports_the_pinned_release(admin: kubernetes.client.ApiClient) -> None:
    pinned = toolpaths.parse_versions(toolpaths.VERSIONS_FILE.read_text())["KUBE_VERSION"]
    info = kubernetes.client.VersionApi(admin).get_code()
    assert info.git_version == pinned
    assert (info.major, info.minor) == ("1", "34")


def test_service_account_token_is_issued_and_rbac_decides_its_access(
    kube_cluster: cluster.KubeCluster, admin: kubernetes.client.ApiClient, namespace: str
) -> None:
    core = kubernetes.client.CoreV1Api(admin)
    core.create_namespaced_service_account(
        namespace,
        kubernetes.client.V1ServiceAccount(metadata=kubernetes.client.V1ObjectMeta(name="reader")),
    )
    token_request = core.create_namespaced_service_account_token(
        "reader",
        namespace,
        kubernetes.client.AuthenticationV1TokenRequest(
            spec=kubernetes.client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)
        ),
    )
    assert token_request.status is not None
    token = token_request.status.token
    assert token

    sa_client = kube_cluster.token_client(token)
    try:
        review = kubernetes.client.AuthenticationV1Api(sa_client).create_self_subject_review(
            kubernetes.client.V1SelfSubjectReview()
        )
        assert review.status is not None and review.status.user_info is not None
        assert review.status.user_info.username == f"system:serviceaccount:{namespace}:reader"

        sa_core = kubernetes.client.CoreV1Api(sa_client)
        with pytest.raises(ApiException) as denied:
            sa_core.list_namespaced_secret(namespace)
        assert denied.value.status == 403

        rbac = kubernetes.client.RbacAuthorizationV1Api(admin)
        rbac.create_namespaced_role(
            namespace,
            kubernetes.client.V1Role(
                metadata=kubernetes.client.V1ObjectMeta(name="secret-reader"),
                rules=[
                    kubernetes.client.V1PolicyRule(
                        api_groups=[""], resources=["secrets"], verbs=["list"]
                    )
                ],
            ),
        )
        rbac.create_namespaced_role_binding(
            namespace,
            kubernetes.client.V1RoleBinding(
                metadata=kubernetes.client.V1ObjectMeta(name="reader-reads-secrets"),
                role_ref=kubernetes.client.V1RoleRef(
                    api_group="rbac.authorization.k8s.io", kind="Role", name="secret-reader"
                ),
                subjects=[
                    kubernetes.client.RbacV1Subject(
                        kind="ServiceAccount", name="reader", namespace=namespace
                    )
                ],
            ),
        )
        # RBAC decisions follow the binding at once (the authorizer watches roles).
        deadline = time.monotonic() + 30
        while True:
            try:
                sa_core.list_namespaced_secret(namespace)
                break
            except ApiException as err:
                if err.status != 403 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        # The grant is exactly what was bound: other namespaces stay closed.
        with pytest.raises(ApiException) as other:
            sa_core.list_namespaced_secret("kube-system")
        assert other.value.status == 403
    finally:
        sa_client.close()  # type: ignore[no-untyped-call]


def test_job_pods_are_created_scheduled_and_run_on_fake_nodes(
    admin: kubernetes.client.ApiClient, namespace: str
) -> None:
    job = kubernetes.client.V1Job(
        metadata=kubernetes.client.V1ObjectMeta(name="hello"),
        spec=kubernetes.client.V1JobSpec(
            backoff_limit=0,
            template=kubernetes.client.V1PodTemplateSpec(
                spec=kubernetes.client.V1PodSpec(
                    restart_policy="Never",
                    containers=[kubernetes.client.V1Container(name="main", image="busybox:1.36")],
                )
            ),
        ),
    )
    kubernetes.client.BatchV1Api(admin).create_namespaced_job(namespace, job)
    core = kubernetes.client.CoreV1Api(admin)
    deadline = time.monotonic() + POD_RUNNING_TIMEOUT_S
    phase, node = None, None
    while time.monotonic() < deadline:
        pods = core.list_namespaced_pod(namespace, label_selector="job-name=hello").items
        if pods and pods[0].status is not None and pods[0].spec is not None:
            phase, node = pods[0].status.phase, pods[0].spec.node_name
            if phase in ("Running", "Succeeded"):
                break
        time.sleep(0.5)
    assert phase in ("Running", "Succeeded"), f"the Job's pod is {phase} on {node}"
    assert node is not None
    metadata = core.read_node(node).metadata
    assert metadata is not None
    annotations = metadata.annotations or {}
    assert annotations.get("kwok.x-k8s.io/node") == "fake"
