"""The uninstall guard against the real API server, with the operator's own service
account token, as the chart's pre-delete hook Job runs it: it names the DatasetMounts
that exist, lists only the namespaces it is given, and refuses, saying why, when it may
not list. (The hook itself, run by helm on a real kubelet: tests/node/product.)"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import kubernetes.client
import pytest
from kubernetes.client.rest import ApiException
from shardcache_operator import specs

from tests.e2e import harness, objects
from tests.e2e.conftest import Release

pytestmark = pytest.mark.e2e


def guard(kubeconfig: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardcache_operator.uninstall_guard",
         f"--kubeconfig={kubeconfig}", *args],
        capture_output=True, text=True, timeout=120, check=False, env=harness.clean_env(),
    )  # fmt: skip


def token_kubeconfig(
    e2e_cluster: harness.Cluster,
    admin: kubernetes.client.ApiClient,
    namespace: str,
    account: str,
    path: pathlib.Path,
) -> pathlib.Path:
    token = harness.service_account_token(admin, namespace, account, 600)
    path.write_text(
        harness.token_kubeconfig(e2e_cluster.server, e2e_cluster.ca_file, token, account)
    )
    path.chmod(0o600)
    return path


def test_the_operators_identity_sees_the_mounts_that_would_be_stranded(
    e2e_cluster: harness.Cluster,
    admin: kubernetes.client.ApiClient,
    release: Release,
    workload_namespace: str,
    tmp_path: pathlib.Path,
) -> None:
    kubeconfig = token_kubeconfig(
        e2e_cluster, admin, release.namespace, release.service_account, tmp_path / "kubeconfig"
    )
    name = "guarded"
    body = objects.datasetmount(name, "s3://no-such-bucket/data/")
    objects.create_datasetmount(admin, workload_namespace, body)
    custom = kubernetes.client.CustomObjectsApi(admin)
    try:
        refused = guard(kubeconfig)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert refused.stdout.startswith("helm uninstall refused: "), refused.stdout
        assert f"  {workload_namespace}/{name} (" in refused.stdout
        assert "helm uninstall --no-hooks" in refused.stdout
        # A namespaced release guards its own namespaces only.
        scoped = guard(kubeconfig, f"--namespace={release.namespace}")
        assert scoped.returncode == 0, scoped.stdout + scoped.stderr
        assert f"no DatasetMount in {release.namespace}" in scoped.stdout
    finally:
        custom.delete_namespaced_custom_object(
            specs.GROUP, specs.VERSION, workload_namespace, specs.PLURAL, name
        )
        try:  # a running operator drops its finalizer (the mount has no pods)
            harness.wait_until(
                f"DatasetMount {name} gone",
                lambda: gone(admin, workload_namespace, name),
                timeout=60,
            )
        finally:
            if not gone(admin, workload_namespace, name):
                custom.patch_namespaced_custom_object(
                    specs.GROUP, specs.VERSION, workload_namespace, specs.PLURAL, name,
                    {"metadata": {"finalizers": []}},
                )  # fmt: skip


def gone(admin: kubernetes.client.ApiClient, namespace: str, name: str) -> bool:
    try:
        objects.get_datasetmount(admin, namespace, name)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def test_an_identity_that_may_not_list_mounts_refuses_the_uninstall_saying_so(
    e2e_cluster: harness.Cluster,
    admin: kubernetes.client.ApiClient,
    release: Release,
    tmp_path: pathlib.Path,
) -> None:
    core = kubernetes.client.CoreV1Api(admin)
    account = "no-rights"
    core.create_namespaced_service_account(
        release.namespace, kubernetes.client.V1ServiceAccount(metadata={"name": account})
    )
    try:
        kubeconfig = token_kubeconfig(
            e2e_cluster, admin, release.namespace, account, tmp_path / "kubeconfig"
        )
        refused = guard(kubeconfig)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "could not tell whether DatasetMounts exist" in refused.stdout, refused.stdout
        assert "HTTP 403" in refused.stdout, refused.stdout
    finally:
        core.delete_namespaced_service_account(account, release.namespace)
