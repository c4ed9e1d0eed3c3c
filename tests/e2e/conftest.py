"""Fixtures of the e2e suite: a cluster, the chart installed with helm, the operator.

Which cluster is chosen by SHARDCACHE_E2E_CLUSTER (see harness.py): `local` (default;
the loopback control plane `make cluster-up` / the `kube_cluster` fixture start) or
`kind`. Everything here is session-scoped and torn down at the end: DatasetMounts are
released, the operator stopped, the release uninstalled, the CRDs and namespaces
deleted; a control plane the session started is stopped by `kube_cluster`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, cast

import kubernetes.client
import pytest
from kubernetes.client import ApiException
from shardcache_operator import certs, specs
from shardcache_sidecar import listening

from tests.e2e import harness, objects, workloads

CRD_NAMES = (
    "datasetmounts.shardcache.io",
    "clusterkopfpeerings.kopf.dev",
    "kopfpeerings.kopf.dev",
)
#: Releasing every DatasetMount at the end: the operator drops its finalizers.
CLEANUP_TIMEOUT_S = 60.0
#: Deleting a namespace (kwok removes its pods) or a CRD takes seconds.
GONE_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def e2e_workdir() -> Iterator[pathlib.Path]:
    path = pathlib.Path(tempfile.mkdtemp(prefix="shardcache-e2e-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def e2e_cluster(request: pytest.FixtureRequest, e2e_workdir: pathlib.Path) -> harness.Cluster:
    if harness.provider_name() == "kind":
        return harness.kind_cluster(e2e_workdir)
    local = request.getfixturevalue("kube_cluster")
    return harness.Cluster(
        "local", local.kubeconfig, local.helm, local.kubectl, local.server, local.ca_file
    )


@pytest.fixture(scope="session")
def admin(e2e_cluster: harness.Cluster) -> Iterator[kubernetes.client.ApiClient]:
    client = e2e_cluster.api_client()
    try:
        yield client
    finally:
        client.close()  # type: ignore[no-untyped-call]


@pytest.fixture(scope="session")
def object_store(request: pytest.FixtureRequest) -> harness.ObjectStore:
    if harness.provider_name() == "kind":
        return harness.ExternalObjectStore.from_env()
    store: harness.ObjectStore = request.getfixturevalue("s3_server")
    return store


@pytest.fixture(scope="session")
def workload_namespace(admin: kubernetes.client.ApiClient) -> Iterator[str]:
    """Where the tests' DatasetMounts, Secrets, pods and Jobs live."""
    core = kubernetes.client.CoreV1Api(admin)
    name = f"e2e-{secrets.token_hex(4)}"
    core.create_namespace(
        kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name))
    )
    harness.wait_until(
        f"the default ServiceAccount of {name}",
        lambda: core.read_namespaced_service_account("default", name),
        timeout=60,
    )
    try:
        yield name
    finally:
        # Pods on kwok's nodes go away through kwok; no need to wait for it here.
        core.delete_namespace(name, body=kubernetes.client.V1DeleteOptions(grace_period_seconds=0))


@dataclasses.dataclass(frozen=True)
class WebhookTls:
    directory: pathlib.Path
    ca_bundle: str
    port: int


@pytest.fixture(scope="session")
def webhook_tls(e2e_workdir: pathlib.Path) -> WebhookTls:
    """The local operator's serving certificate; the chart's caBundle trusts its CA."""
    bundle = certs.generate([harness.HOST, "localhost"])
    files = certs.write(bundle, e2e_workdir / "tls")
    return WebhookTls(files.ca_file.parent, bundle.ca_bundle, listening.free_port())


@dataclasses.dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    service_account: str
    values: dict[str, Any]
    secret_namespace: str

    @property
    def subject(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


def release_values(
    provider: str, workload_namespace: str, tls: WebhookTls | None
) -> dict[str, Any]:
    repo, tag = harness.OPERATOR_IMAGE
    sidecar_repo, sidecar_tag = harness.SIDECAR_IMAGE
    values: dict[str, Any] = {
        "operator": {
            "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
            "settings": dict(harness.OPERATOR_SETTINGS),
        },
        "sidecar": {"image": {"repository": sidecar_repo, "tag": sidecar_tag}},
        "rbac": {
            "secretNamespaces": [workload_namespace],
            "secretNames": [objects.SECRET_NAME],
            "manifestNamespaces": [workload_namespace],
        },
    }
    # helm's pre-delete hook Job would run on a kwok node that never runs it (helm
    # waits out its time-out), and the session's fixtures release every DatasetMount
    # themselves before the uninstall: the guard is the node tier's (tests/node).
    values["uninstallGuard"] = {"enabled": False}
    if provider == "kind":
        # One replica: metrics come from one pod through port-forward, and a standby
        # replica's counters would stay at zero.
        values["operator"]["replicas"] = 1
    if provider == "local":
        assert tls is not None
        # No kubelet runs the Deployment: the API server calls the local operator.
        values["webhook"] = {
            "url": f"https://{harness.HOST}:{tls.port}/shardcache-inject",
            "caBundle": tls.ca_bundle,
        }
        # The node-cache DaemonSet tolerates every taint, so it would also go to the
        # cluster's real node (tests/node), where its image was never imported: keep it
        # on kwok's nodes (label `type: kwok`) with everything else of this tier.
        values["nodeCache"] = {"nodeSelector": {"type": "kwok"}}
    return values


def _absent(read: Callable[[], object]) -> bool:
    try:
        read()
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def delete_crds(admin: kubernetes.client.ApiClient) -> None:
    ext = kubernetes.client.ApiextensionsV1Api(admin)
    for name in CRD_NAMES:
        try:
            ext.delete_custom_resource_definition(name)
        except ApiException as exc:
            if exc.status != 404:
                raise
    for name in CRD_NAMES:

        def absent(name: str = name) -> bool:
            return _absent(lambda: ext.read_custom_resource_definition(name))

        harness.wait_until(f"CRD {name} to be deleted", absent, timeout=GONE_TIMEOUT_S)


def wait_namespace_gone(admin: kubernetes.client.ApiClient, name: str) -> None:
    """A namespace being deleted refuses new objects: wait until it is gone."""
    core = kubernetes.client.CoreV1Api(admin)
    harness.wait_until(
        f"namespace {name} to be deleted",
        lambda: _absent(lambda: core.read_namespace(name)),
        timeout=GONE_TIMEOUT_S,
    )


@pytest.fixture(scope="session")
def release(
    request: pytest.FixtureRequest,
    e2e_cluster: harness.Cluster,
    admin: kubernetes.client.ApiClient,
    workload_namespace: str,
    e2e_workdir: pathlib.Path,
) -> Iterator[Release]:
    """`helm install` of helm/shardcache into the real API server."""
    tls = request.getfixturevalue("webhook_tls") if e2e_cluster.provider == "local" else None
    values = release_values(e2e_cluster.provider, workload_namespace, tls)
    values_file = e2e_workdir / "values.json"
    values_file.write_text(json.dumps(values, indent=2))
    # A release left by an interrupted earlier run on a reused cluster would collide.
    if harness.uninstall_leftover_release(e2e_cluster, harness.RELEASE, harness.RELEASE_NAMESPACE):
        delete_crds(admin)
    core = kubernetes.client.CoreV1Api(admin)
    with contextlib.suppress(ApiException):
        meta = core.read_namespace(harness.RELEASE_NAMESPACE).metadata
        if meta is not None and meta.deletion_timestamp:
            wait_namespace_gone(admin, harness.RELEASE_NAMESPACE)
    install = [
        "install", harness.RELEASE, str(harness.CHART_DIR),
        "-n", harness.RELEASE_NAMESPACE, "--create-namespace", "-f", str(values_file),
        "--timeout=3m",
    ]  # fmt: skip
    if e2e_cluster.provider == "kind":
        install.append("--wait")
    e2e_cluster.run("helm", *install)
    try:
        yield Release(
            harness.RELEASE,
            harness.RELEASE_NAMESPACE,
            harness.SERVICE_ACCOUNT,
            values,
            workload_namespace,
        )
    finally:
        e2e_cluster.run(
            "helm", "uninstall", harness.RELEASE, "-n", harness.RELEASE_NAMESPACE, check=False
        )
        # helm leaves CRDs installed on purpose; a later session must get today's.
        delete_crds(admin)
        # Gone, not just going: a session right after this one installs it again.
        with contextlib.suppress(ApiException):
            core.delete_namespace(harness.RELEASE_NAMESPACE)
        wait_namespace_gone(admin, harness.RELEASE_NAMESPACE)


def _release_all_datasetmounts(admin: kubernetes.client.ApiClient) -> None:
    """Delete every DatasetMount (forced) while the operator still runs to drop its
    finalizer; strip what is left after the time-out so the CRD can go."""
    custom = kubernetes.client.CustomObjectsApi(admin)
    group, version, plural = specs.GROUP, specs.VERSION, specs.PLURAL

    def remaining() -> list[dict[str, Any]]:
        listing = custom.list_cluster_custom_object(group, version, plural)
        return list(cast(dict[str, Any], listing).get("items", []))

    for obj in remaining():
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        patch = {"metadata": {"annotations": {specs.ANNOTATION_FORCE_DELETE: "true"}}}
        try:
            custom.patch_namespaced_custom_object(group, version, ns, plural, name, patch)
            custom.delete_namespaced_custom_object(group, version, ns, plural, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
    try:
        harness.wait_until(
            "the operator to release every DatasetMount",
            lambda: not remaining(),
            timeout=CLEANUP_TIMEOUT_S,
        )
    finally:
        for obj in remaining():
            ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
            custom.patch_namespaced_custom_object(
                group, version, ns, plural, name, {"metadata": {"finalizers": []}}
            )


@pytest.fixture(scope="session")
def operator(
    request: pytest.FixtureRequest,
    e2e_cluster: harness.Cluster,
    admin: kubernetes.client.ApiClient,
    release: Release,
    e2e_workdir: pathlib.Path,
) -> Iterator[harness.Operator]:
    """The operator, serving DatasetMounts and the webhook under the chart's identity."""
    if e2e_cluster.provider == "kind":
        in_cluster = harness.InClusterOperator(
            e2e_cluster, f"{release.name}-operator", release.namespace
        )
        in_cluster.wait_rolled_out()
        try:
            yield in_cluster
        finally:
            _release_all_datasetmounts(admin)
        return
    tls: WebhookTls = request.getfixturevalue("webhook_tls")
    token = harness.service_account_token(admin, release.namespace, release.service_account)
    kubeconfig = e2e_workdir / "operator-kubeconfig"
    kubeconfig.write_text(
        harness.token_kubeconfig(
            e2e_cluster.server, e2e_cluster.ca_file, token, release.service_account
        )
    )
    kubeconfig.chmod(0o600)
    sidecar_repo, sidecar_tag = harness.SIDECAR_IMAGE
    store: harness.ObjectStore = request.getfixturevalue("object_store")
    local = harness.LocalOperator(
        e2e_workdir,
        kubeconfig,
        tls.directory,
        tls.port,
        f"{sidecar_repo}:{sidecar_tag}",
        source_endpoints=(store.endpoint_url,),
        manifest_namespaces=tuple(release.values["rbac"]["manifestNamespaces"]),
    )
    local.start()
    try:
        yield local
    finally:
        try:
            _release_all_datasetmounts(admin)
        finally:
            local.stop()


@pytest.fixture(scope="session")
def s3_secret(
    admin: kubernetes.client.ApiClient, workload_namespace: str, object_store: harness.ObjectStore
) -> str:
    """The Secret DatasetMounts reference: the object store's AWS_* settings."""
    kubernetes.client.CoreV1Api(admin).create_namespaced_secret(
        workload_namespace,
        kubernetes.client.V1Secret(
            metadata=kubernetes.client.V1ObjectMeta(name=objects.SECRET_NAME),
            string_data={
                "AWS_ACCESS_KEY_ID": object_store.access_key,
                "AWS_SECRET_ACCESS_KEY": object_store.secret_key,
                "AWS_ENDPOINT_URL": object_store.endpoint_url,
                "AWS_REGION": object_store.region,
            },
        ),
    )
    return objects.SECRET_NAME


@pytest.fixture(scope="session")
def workload(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> workloads.Workload:
    """For tests that make their own DatasetMounts and pods (`s3_secret`: the Secret the
    mounts name exists)."""
    return workloads.Workload(admin, operator, workload_namespace, object_store)


@dataclasses.dataclass(frozen=True)
class ReadyMount:
    namespace: str
    name: str
    uri: str
    status: dict[str, Any]


@pytest.fixture(scope="session")
def ready_mount(
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> ReadyMount:
    """A Ready DatasetMount on three Parquet shards in the real object store."""
    uri = objects.write_shards(object_store, shard_rows=(40, 25, 31))
    name = "train"
    objects.create_datasetmount(admin, workload_namespace, objects.datasetmount(name, uri))
    status = objects.wait_phase(admin, workload_namespace, name, "Ready", operator)
    return ReadyMount(workload_namespace, name, uri, status)
