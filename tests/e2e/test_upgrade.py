"""Upgrades that skip the CRDs, and uninstalls with DatasetMounts left (docs/operator.md,
"Upgrading" and "Uninstalling").

helm installs a chart's crds/ on first install only. An upgrade that left an older
DatasetMount CRD let the API server prune status fields the new operator wrote, and
every operator restart then moved the pin (the helm exploration's defect 1): now the
chart refuses such an upgrade, and the operator reconciles nothing against an older CRD,
saying what to run. The older CRD here is today's marked schema version 0 (what the
gate takes a CRD without the annotation for): the gate reads nothing else, and the
session's other mounts lose no field while it is installed.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import kubernetes.client
import pytest
import yaml
from shardcache_operator import crd, crd_version

from tests.e2e import harness, objects
from tests.e2e.conftest import Release
from tests.support import datasets

pytestmark = pytest.mark.e2e

CRD_FILE = harness.REPO_ROOT / "crds" / "datasetmount.yaml"
DOCS = harness.REPO_ROOT / "docs" / "operator.md"
#: Seconds for the gate to look again and the retried resolve to pin.
RECHECK_TIMEOUT_S = crd_version.RECHECK_SECONDS * 2 + 30


def apply(cluster: harness.Cluster, text: str) -> None:
    cluster.run("kubectl", "apply", "--server-side", "--force-conflicts", "-f", "-", stdin=text)


def older_crd() -> str:
    """Today's CRD marked as schema version 0, as the gate reads one without the
    annotation (a chart before it: a server-side apply cannot take away an annotation
    another field manager, helm, set)."""
    obj = yaml.safe_load(CRD_FILE.read_text())
    obj["metadata"]["annotations"] = {crd.ANNOTATION_SCHEMA_VERSION: "0"}
    return yaml.safe_dump(obj)


@pytest.fixture
def stale_crd(e2e_cluster: harness.Cluster, release: Release) -> Iterator[None]:
    """An older DatasetMount CRD while the test runs; today's again afterwards."""
    apply(e2e_cluster, older_crd())
    try:
        yield
    finally:
        e2e_cluster.run(
            "kubectl", "apply", "--server-side", "--force-conflicts",
            "-f", str(harness.REPO_ROOT / "crds"),
        )  # fmt: skip


def test_helm_upgrade_over_an_older_crd_is_refused_until_the_crds_are_applied(
    e2e_cluster: harness.Cluster, release: Release, tmp_path: pathlib.Path
) -> None:
    name, namespace = "upgrade-check", "shardcache-upgrade-check"
    values = [
        "--set=webhook.enabled=false", "--set=nodeCache.prepare=false",
        "--set=operator.replicas=1", "--set=peering.enabled=false",
        "--set=uninstallGuard.enabled=false",  # a hook Job kwok's nodes never run
    ]  # fmt: skip
    chart = str(harness.CHART_DIR)
    e2e_cluster.run("helm", "install", name, chart, "-n", namespace, "--create-namespace", *values)
    try:
        apply(e2e_cluster, older_crd())
        try:
            refused = e2e_cluster.run(
                "helm", "upgrade", name, chart, "-n", namespace, *values, check=False
            )
            assert refused.returncode != 0, refused.stdout
            message = " ".join(refused.stderr.split())
            assert "is schema version 0, this chart" in message, message
            assert "kubectl apply --server-side --force-conflicts -f <this chart>/crds/" in message
            history = e2e_cluster.run("helm", "history", name, "-n", namespace, "-o", "json")
            assert len(json.loads(history.stdout)) == 1, "the refused upgrade left a revision"
        finally:
            e2e_cluster.run(
                "kubectl", "apply", "--server-side", "--force-conflicts",
                "-f", str(harness.REPO_ROOT / "crds"),
            )  # fmt: skip
        e2e_cluster.run("helm", "upgrade", name, chart, "-n", namespace, *values)
    finally:
        e2e_cluster.run("helm", "uninstall", name, "-n", namespace, check=False)
        e2e_cluster.run("kubectl", "delete", "namespace", namespace, "--wait=false", check=False)


#: The first chart (before nodeCache, policy and monitoring were values).
FIRST_CHART_COMMIT = "a485487"


def test_reuse_values_from_the_first_chart_says_what_to_do_instead_of_a_nil_pointer(
    e2e_cluster: harness.Cluster, release: Release, tmp_path: pathlib.Path
) -> None:
    archive = subprocess.run(
        ["git", "-C", str(harness.REPO_ROOT), "archive", FIRST_CHART_COMMIT, "helm/shardcache"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        pytest.skip(f"no chart of commit {FIRST_CHART_COMMIT} here (a shallow clone?)")
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    old = tmp_path / "helm" / "shardcache"
    (old / "crds").unlink()  # a link to the repo's crds/ then, not in this archive
    name, namespace = "reuse-check", "shardcache-reuse-check"
    values = ["--set=webhook.enabled=false", "--set=operator.replicas=1"]
    values.append("--set=peering.enabled=false")
    # The CRDs are the session's.
    e2e_cluster.run(
        "helm", "install", name, str(old), "-n", namespace, "--create-namespace", *values
    )
    try:
        chart = str(harness.CHART_DIR)
        reused = e2e_cluster.run(
            "helm", "upgrade", name, chart, "-n", namespace, "--reuse-values", check=False
        )
        assert reused.returncode != 0
        assert "nil pointer" not in reused.stderr, reused.stderr
        message = " ".join(reused.stderr.split())
        assert "the values lack" in message and "nodeCache" in message, message
        assert "--reset-then-reuse-values" in message, message
        e2e_cluster.run(
            "helm", "upgrade", name, chart, "-n", namespace, "--reset-then-reuse-values",
            "--set=nodeCache.prepare=false", "--set=uninstallGuard.enabled=false",
        )  # fmt: skip
    finally:
        e2e_cluster.run("helm", "uninstall", name, "-n", namespace, check=False)
        e2e_cluster.run("kubectl", "delete", "namespace", namespace, "--wait=false", check=False)


def readyz(operator: harness.Operator) -> tuple[int, str]:
    assert isinstance(operator, harness.LocalOperator)
    url = f"http://{harness.HOST}:{operator.health_port}/readyz"
    with urllib.request.urlopen(url, timeout=5) as response:
        return int(response.status), response.read().decode()


def test_operator_reconciles_nothing_against_an_older_crd_and_goes_on_once_applied(
    e2e_cluster: harness.Cluster,
    admin: kubernetes.client.ApiClient,
    operator: harness.Operator,
    workload_namespace: str,
    object_store: harness.ObjectStore,
    s3_secret: str,
) -> None:
    if not isinstance(operator, harness.LocalOperator):
        pytest.skip("reads the local operator's /readyz")
    uri = objects.write_shards(object_store, shard_rows=(10, 10, 10))
    name = objects.unique("stale-crd")
    operator.stop()
    apply(e2e_cluster, older_crd())
    try:
        operator.start()
        status, text = readyz(operator)
        # Ready (the webhook still serves pins made before), saying what to run.
        assert status == 200 and text.startswith("ready (webhook only): "), text
        assert crd_version.APPLY in text
        assert crd_version.APPLY in operator.logs()
        created = objects.create_datasetmount(
            admin, workload_namespace, objects.datasetmount(name, uri)
        )
        uid = created["metadata"]["uid"]
        (event,) = harness.wait_until(
            "a CRDOutdated Event",
            lambda: objects.events_with(admin, workload_namespace, uid, crd_version.REASON) or None,
            timeout=60,
            describe=operator.logs,
        )
        assert event.type == "Warning" and crd_version.APPLY in (event.message or "")
        current = objects.get_datasetmount(admin, workload_namespace, name)
        assert not (current.get("status") or {}).get("manifestDigest")
    finally:
        e2e_cluster.run(
            "kubectl", "apply", "--server-side", "--force-conflicts",
            "-f", str(harness.REPO_ROOT / "crds"),
        )  # fmt: skip
    try:
        # No restart: the operator looks again and resolves.
        pinned = objects.wait_phase(
            admin, workload_namespace, name, "Ready", operator, timeout=RECHECK_TIMEOUT_S
        )
        assert readyz(operator) == (200, "ready\n")
        # The bucket changes, the operator restarts: the pin stays.
        bucket_prefix = uri.removeprefix("s3://").rstrip("/")
        datasets.write_dataset(object_store.filesystem(), bucket_prefix, (10, 10, 10, 10))
        operator.restart()
        custom = kubernetes.client.CustomObjectsApi(admin)
        listing = custom.list_cluster_custom_object(objects.GROUP, objects.VERSION, objects.PLURAL)
        every = len(listing["items"])  # type: ignore[index]

        def resumed() -> bool:
            text = operator.metrics()
            return harness.metric_value(text, "shardcache_operator_reconcile_total") >= every

        harness.wait_until(
            "the restarted operator to resume every DatasetMount",
            resumed,
            timeout=90,
            describe=operator.logs,
        )
        after = objects.get_datasetmount(admin, workload_namespace, name)["status"]
        assert after["manifestDigest"] == pinned["manifestDigest"]
        assert after.get("resolvedAt") == pinned.get("resolvedAt")
        assert after["shards"] == 3
    finally:
        kubernetes.client.CustomObjectsApi(admin).delete_namespaced_custom_object(
            objects.GROUP, objects.VERSION, workload_namespace, objects.PLURAL, name
        )


def uninstall_command() -> str:
    """The command docs/operator.md ("Uninstalling") gives for stranded finalizers."""
    text = DOCS.read_text()
    section = text[text.index("## Uninstalling") :]
    match = re.search(r"```sh\n(kubectl get datasetmounts -A.*?)\n```", section, re.S)
    assert match, "docs/operator.md, Uninstalling: the finalizer command block is missing"
    return match.group(1)


def test_the_documented_command_releases_the_finalizers_an_uninstall_stranded(
    e2e_cluster: harness.Cluster,
    admin: kubernetes.client.ApiClient,
    release: Release,
    e2e_workdir: pathlib.Path,
) -> None:
    """With the operator gone (helm uninstall before the mounts were deleted), the
    command in the docs lets a tenant namespace finish deleting (defect 4)."""
    core = kubernetes.client.CoreV1Api(admin)
    namespace = objects.unique("stranded")
    core.create_namespace({"metadata": {"name": namespace}})
    body: dict[str, Any] = copy.deepcopy(objects.datasetmount("data", "s3://b/p/", secret=None))
    body["metadata"]["finalizers"] = ["shardcache.io/finalizer"]  # as the operator left it
    objects.create_datasetmount(admin, namespace, body)
    core.delete_namespace(namespace)
    env = harness.clean_env()
    env["KUBECONFIG"] = str(e2e_cluster.kubeconfig)
    env["PATH"] = f"{pathlib.Path(e2e_cluster.kubectl).parent}:{env.get('PATH', '')}"
    subprocess.run(["bash", "-c", uninstall_command()], env=env, check=True, timeout=60)
    harness.wait_until(
        f"namespace {namespace} to be deleted",
        lambda: namespace not in [n.metadata.name for n in core.list_namespace().items],
        timeout=60,
    )
