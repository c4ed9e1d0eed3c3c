"""The chart's node-cache DaemonSet with `nodeCache.reclaim`, rendered with `helm
template` (no cluster): the reclaim container runs the module it names, as the
sidecar's user, every `intervalSeconds`; its service account may only list namespaces,
and only that container gets its token; off, the DaemonSet idles as before."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from shardcache_operator import node_reclaim

from tests.unit.test_chart_operator_render import helm_template, rendered

pytestmark = pytest.mark.unit


def node_cache(tmp_path: Path, *args: str) -> dict[str, list[dict[str, Any]]]:
    """The node-cache objects by kind."""
    found: dict[str, list[dict[str, Any]]] = {}
    for doc in rendered(tmp_path, *args):
        labels = doc["metadata"].get("labels", {})
        if labels.get("app.kubernetes.io/component") == "node-cache":
            found.setdefault(doc["kind"], []).append(doc)
    return found


def pod_spec(objects: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    (daemonset,) = objects["DaemonSet"]
    return daemonset["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def test_the_reclaim_container_runs_the_reclaim_module_as_the_sidecars_user(
    tmp_path: Path,
) -> None:
    spec = pod_spec(node_cache(tmp_path, "--set=nodeCache.uid=1000,nodeCache.gid=1000"))
    (container,) = spec["containers"]
    assert container["name"] == "reclaim"
    python, flag, module, root, interval = container["command"]
    assert (python, flag, root) == ("python3", "-m", "/node-cache")
    assert importlib.util.find_spec(module) is not None
    assert module == node_reclaim.__name__
    assert interval == "--interval-seconds=600"
    context = container["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"], context["runAsNonRoot"]) == (
        1000,
        1000,
        True,
    )
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["allowPrivilegeEscalation"] is False
    assert {m["mountPath"] for m in container["volumeMounts"]} == {
        "/node-cache",
        "/var/run/secrets/kubernetes.io/serviceaccount",
    }


def test_the_interval_reaches_the_program(tmp_path: Path) -> None:
    spec = pod_spec(node_cache(tmp_path, "--set=nodeCache.reclaim.intervalSeconds=5"))
    (container,) = spec["containers"]
    args = node_reclaim.parse(container["command"][3:])
    assert (args.root, args.interval_seconds, args.once) == (Path("/node-cache"), 5.0, False)


def test_the_service_account_may_only_list_namespaces(tmp_path: Path) -> None:
    objects = node_cache(tmp_path)
    (account,) = objects["ServiceAccount"]
    (role,) = objects["ClusterRole"]
    (binding,) = objects["ClusterRoleBinding"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "rel-system"}
    ]
    spec = pod_spec(objects)
    assert spec["serviceAccountName"] == account["metadata"]["name"]
    # The token reaches the reclaim container alone, not the root init container.
    assert spec["automountServiceAccountToken"] is False
    (prepare,) = spec["initContainers"]
    assert [m["name"] for m in prepare["volumeMounts"]] == ["node-cache"]


def test_without_rbac_create_the_binding_is_left_to_the_platform(tmp_path: Path) -> None:
    objects = node_cache(tmp_path, "--set=rbac.create=false")
    assert "ClusterRole" not in objects and "ClusterRoleBinding" not in objects
    assert len(objects["ServiceAccount"]) == 1


def test_reclaim_off_leaves_an_idle_container_and_no_api_access(tmp_path: Path) -> None:
    objects = node_cache(tmp_path, "--set=nodeCache.reclaim.enabled=false")
    assert set(objects) == {"DaemonSet"}
    spec = pod_spec(objects)
    (container,) = spec["containers"]
    assert container["name"] == "idle"
    assert "serviceAccountName" not in spec
    assert [v["name"] for v in spec["volumes"]] == ["node-cache"]


@pytest.mark.parametrize(
    "value", ["nodeCache.reclaim.intervalSeconds=0", "nodeCache.reclaim.every=5"]
)
def test_a_bad_reclaim_value_is_refused_by_the_schema(tmp_path: Path, value: str) -> None:
    result = helm_template(tmp_path, f"--set={value}")
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert "reclaim" in result.stderr
