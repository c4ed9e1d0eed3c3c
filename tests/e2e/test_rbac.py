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
from tests.e2e.conftest import Release, wait_namespace_gone

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
    # A namespace's UID keys its node disk directory (namespace_uids).
    ("get", "namespaces", ""),
    ("list", "namespaces", ""),
    ("watch", "namespaces", ""),
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
    # Objects it has no use for (ConfigMaps: `configmap_rows`).
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


#: ConfigMaps: `get`, `create`, `update` and `delete` only in rbac.manifestNamespaces,
#: where the operator hands pinned manifests to the sidecars (manifest_handoff); never
#: list, watch or patch, never anywhere else.
CONFIGMAP_WRITES = [(verb, "configmaps", WS) for verb in ("get", "create", "update", "delete")]
CONFIGMAPS_DENIED = [
    ("list", "configmaps", WS),
    ("watch", "configmaps", WS),
    ("patch", "configmaps", WS),
    ("list", "configmaps", ALL),
    ("get", "configmaps", "default"),
    ("create", "configmaps", "kube-system"),
    ("create", "configmaps", OWN),
]


def configmap_rows(
    release: Release,
) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(allowed, denied) ConfigMap rows for `release`: the writes in its workload
    namespace are allowed only when its values list that namespace in
    rbac.manifestNamespaces; nothing else about ConfigMaps ever is."""
    rbac = release.values.get("rbac") or {}
    if release.secret_namespace in (rbac.get("manifestNamespaces") or []):
        return CONFIGMAP_WRITES, CONFIGMAPS_DENIED
    return [], CONFIGMAP_WRITES + CONFIGMAPS_DENIED


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
    maps_allowed, maps_denied = configmap_rows(release)
    for verb, resource, ns in ALLOWED + maps_allowed:
        if not can_i(e2e_cluster, release, verb, resource, ns):
            wrong.append(f"cannot {verb} {resource} in {ns or 'cluster'} but needs to")
    for verb, resource, ns in DENIED + maps_denied:
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


def test_namespaced_install_reads_pods_only_in_its_namespaces(
    e2e_cluster: harness.Cluster, admin: kubernetes.client.ApiClient, release: Release
) -> None:
    """operator.watchNamespaces: a second release whose identity reaches pods,
    DatasetMounts and peering only in the namespace it watches, never cluster-wide;
    with rbac.manifestNamespaces, the ConfigMaps of that namespace alone."""
    name, namespace, watched = "scoped", "shardcache-scoped", release.secret_namespace
    install = e2e_cluster.run(
        "helm", "install", name, str(harness.CHART_DIR), f"--namespace={namespace}",
        "--create-namespace", f"--set=operator.watchNamespaces={{{watched}}}",
        "--set=webhook.enabled=false", "--set=peering.name=scoped", "--set=operator.replicas=1",
        "--set=uninstallGuard.enabled=false",  # a hook Job kwok's nodes never run
        f"--set=rbac.manifestNamespaces={{{watched}}}",
    )  # fmt: skip
    assert "STATUS: deployed" in install.stdout
    values = {"rbac": {"manifestNamespaces": [watched]}}
    scoped = Release(name, namespace, f"{name}-shardcache", values, watched)
    maps_allowed, maps_denied = configmap_rows(scoped)
    assert maps_allowed
    try:
        allowed = [
            ("list", "pods", WS),
            ("watch", "datasetmounts.shardcache.io", WS),
            ("patch", "datasetmounts.shardcache.io/status", WS),
            ("patch", "kopfpeerings.kopf.dev/scoped", WS),
            ("list", "customresourcedefinitions.apiextensions.k8s.io", ""),
            ("get", f"namespaces/{watched}", ""),
            ("watch", f"namespaces/{watched}", ""),
            *maps_allowed,
        ]
        denied = [
            ("list", "pods", ALL),
            ("list", "pods", "default"),
            ("list", "datasetmounts.shardcache.io", ALL),
            ("list", "datasetmounts.shardcache.io", "default"),
            ("patch", "clusterkopfpeerings.kopf.dev/shardcache", ""),
            ("get", f"secrets/{objects.SECRET_NAME}", WS),
            ("list", "namespaces", ""),
            ("get", "namespaces/default", ""),
            *maps_denied,
        ]
        wrong = [
            f"cannot {v} {r} in {ns or 'cluster'}"
            for v, r, ns in allowed
            if not can_i(e2e_cluster, scoped, v, r, ns)
        ] + [
            f"can {v} {r} in {ns or 'cluster'}"
            for v, r, ns in denied
            if can_i(e2e_cluster, scoped, v, r, ns)
        ]
        assert not wrong, "\n".join(wrong)
    finally:
        e2e_cluster.run("helm", "uninstall", name, f"--namespace={namespace}", check=False)
        kubernetes.client.CoreV1Api(admin).delete_namespace(namespace)
        wait_namespace_gone(admin, namespace)
