"""The operator's identity can do what it needs and nothing else.

A `kubectl auth can-i --as=system:serviceaccount:<release ns>:<sa>` matrix against the
real API server's RBAC authorizer, with the chart's Roles and ClusterRole installed, and
one real request with the ServiceAccount's own token to show the denial is enforced.
"""

from __future__ import annotations

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException

from tests.e2e import harness, objects
from tests.e2e.conftest import Release

pytestmark = pytest.mark.e2e

WS = "{workload}"  # replaced by the test's workload namespace
OWN = "{release}"  # replaced by the release's namespace
ALL = "*"  # --all-namespaces

#: (verb, resource, namespace): what the operator needs, each for a reason in
#: templates/rbac.yaml and docs/e2e.md.
ALLOWED = [
    ("list", "datasetmounts.shardcache.io", ALL),
    ("watch", "datasetmounts.shardcache.io", ALL),
    ("patch", "datasetmounts.shardcache.io", WS),
    ("patch", "datasetmounts.shardcache.io/status", WS),
    ("list", "pods", ALL),
    ("watch", "pods", ALL),
    ("create", "events", WS),
    ("get", f"secrets/{objects.SECRET_NAME}", WS),
    ("list", "clusterkopfpeerings.kopf.dev", ""),
    ("watch", "clusterkopfpeerings.kopf.dev", ""),
    ("patch", "clusterkopfpeerings.kopf.dev/shardcache", ""),
    ("list", "customresourcedefinitions.apiextensions.k8s.io", ""),
]
DENIED = [
    # Secrets: only `get` of the one named Secret, only in the namespace it was granted.
    ("get", "secrets/some-other-secret", WS),
    ("list", "secrets", WS),
    ("watch", "secrets", WS),
    ("get", f"secrets/{objects.SECRET_NAME}", "default"),
    ("get", f"secrets/{objects.SECRET_NAME}", "kube-system"),
    ("get", "secrets/shardcache-webhook-tls", OWN),
    ("list", "secrets", ALL),
    ("create", "secrets", WS),
    # Objects it has no use for.
    ("get", "configmaps", WS),
    ("list", "configmaps", ALL),
    ("get", "nodes", ""),
    ("list", "deployments.apps", ALL),
    ("get", "serviceaccounts", OWN),
    ("create", "serviceaccounts/token", OWN),
    # Pods are injected in the admission response, never written afterwards.
    ("get", "pods", WS),
    ("create", "pods", WS),
    ("patch", "pods", WS),
    ("delete", "pods", WS),
    ("create", "pods/exec", WS),
    # DatasetMounts belong to their users.
    ("create", "datasetmounts.shardcache.io", WS),
    ("delete", "datasetmounts.shardcache.io", WS),
    ("update", "datasetmounts.shardcache.io", WS),
    # No way to grow its own rights or rewire admission.
    ("patch", "mutatingwebhookconfigurations.admissionregistration.k8s.io", ""),
    ("create", "rolebindings.rbac.authorization.k8s.io", WS),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", ""),
    ("escalate", "clusterroles.rbac.authorization.k8s.io", ""),
    ("impersonate", "users", ""),
    ("patch", "clusterkopfpeerings.kopf.dev/someone-else", ""),
    ("delete", "clusterkopfpeerings.kopf.dev/shardcache", ""),
    ("delete", "events", WS),
    ("patch", "customresourcedefinitions.apiextensions.k8s.io", ""),
]


def can_i(cluster: harness.Cluster, release: Release, verb: str, resource: str, ns: str) -> bool:
    args = ["auth", "can-i", verb, resource, f"--as={release.subject}"]
    if ns == ALL:
        args.append("--all-namespaces")
    elif ns:
        args.append(
            f"--namespace={ns.format(workload=release.secret_namespace, release=release.namespace)}"
        )
    result = cluster.run("kubectl", *args, check=False)
    answer = result.stdout.strip()
    if answer not in ("yes", "no"):
        raise AssertionError(f"kubectl {' '.join(args)}: {result.stdout}{result.stderr}")
    return answer == "yes"


def test_operator_identity_has_exactly_the_permissions_it_needs(
    e2e_cluster: harness.Cluster, release: Release
) -> None:
    wrong: list[str] = []
    for verb, resource, ns in ALLOWED:
        if not can_i(e2e_cluster, release, verb, resource, ns):
            wrong.append(f"cannot {verb} {resource} in {ns or 'cluster'} but needs to")
    for verb, resource, ns in DENIED:
        if can_i(e2e_cluster, release, verb, resource, ns):
            wrong.append(f"can {verb} {resource} in {ns or 'cluster'} but must not")
    assert not wrong, "\n".join(wrong)


def test_service_account_token_is_refused_other_secrets(
    e2e_cluster: harness.Cluster,
    admin: kubernetes.client.ApiClient,
    release: Release,
    s3_secret: str,
) -> None:
    """Not only the authorizer's answer: a real read with the operator's token."""
    token = harness.service_account_token(admin, release.namespace, release.service_account, 600)
    configuration = kubernetes.client.Configuration()
    configuration.host = e2e_cluster.server
    if e2e_cluster.ca_file is not None:
        configuration.ssl_ca_cert = str(e2e_cluster.ca_file)
    configuration.api_key = {"authorization": token}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    with kubernetes.client.ApiClient(configuration) as client:
        core = kubernetes.client.CoreV1Api(client)
        secret = core.read_namespaced_secret(s3_secret, release.secret_namespace)
        assert secret.metadata.name == s3_secret
        for call in (
            lambda: core.list_namespaced_secret(release.secret_namespace),
            lambda: core.read_namespaced_secret(f"{release.name}-webhook-tls", release.namespace),
            lambda: core.list_namespaced_config_map(release.secret_namespace),
        ):
            with pytest.raises(ApiException) as denied:
                call()
            assert denied.value.status == 403
