"""The chart's node-cache DaemonSet with `nodeCache.reclaim`, rendered with `helm
template` (no cluster): the reclaim container runs the module it names, as the
sidecar's user, every `intervalSeconds`; its service account may only list namespaces,
and only that container gets its token; off, the DaemonSet idles as before. Every
`policy.nodePaths` entry is a hostPath volume of its own (named by its index), which
the prepare and reclaim containers both mount and are both given."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
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
    python, flag, module, root, node_path, interval = container["command"]
    assert (python, flag, root) == ("python3", "-m", "/node-cache")
    assert node_path == "--node-path=/var/cache/shardcache", "the logs name the node's path"
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
    assert (args.roots, args.interval_seconds, args.once) == ([Path("/node-cache")], 5.0, False)


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


def test_the_reclaim_containers_resources_are_the_values(tmp_path: Path) -> None:
    """A cluster whose LimitRange or scale asks for others sets them; the default is the
    chart's measured one."""
    (default,) = pod_spec(node_cache(tmp_path))["containers"]
    assert default["resources"] == {
        "requests": {"cpu": "5m", "memory": "128Mi"},
        "limits": {"memory": "256Mi"},
    }
    (raised,) = pod_spec(node_cache(
        tmp_path, "--set=nodeCache.reclaim.resources.limits.memory=1Gi",
        "--set=nodeCache.reclaim.resources.requests.cpu=50m",
    ))["containers"]  # fmt: skip
    assert raised["resources"] == {
        "requests": {"cpu": "50m", "memory": "128Mi"},
        "limits": {"memory": "1Gi"},
    }


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


#: A node path longer than a volume name may be (63), of characters one may not have.
LONG = "/mnt/Fast_NVMe.0/" + "/".join(["a-rather-long-directory-name"] * 4)
#: What a volume name must be: a DNS label (RFC 1123).
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def node_path_volumes(spec: dict[str, Any]) -> dict[str, str]:
    """The DaemonSet's hostPath volumes: name -> node path."""
    return {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}


def test_every_allowed_node_path_is_its_own_volume_mounted_for_prepare_and_reclaim(
    tmp_path: Path,
) -> None:
    """nodeCache.path first (where charts before mounted it), then the other entries in
    their order, each at /<volume name>; both containers get every mount point."""
    spec = pod_spec(node_cache(
        tmp_path, f"--set=policy.nodePaths={{/mnt/a,/var/cache/shardcache,{LONG}}}",
        "--set=nodeCache.uid=1000,nodeCache.gid=1000",
    ))  # fmt: skip
    volumes = node_path_volumes(spec)
    assert volumes == {
        "node-cache": "/var/cache/shardcache",
        "node-cache-1": "/mnt/a",
        "node-cache-2": LONG,
    }
    assert all(DNS_LABEL.fullmatch(name) for name in volumes), volumes
    assert all(
        v["hostPath"]["type"] == "DirectoryOrCreate" for v in spec["volumes"] if "hostPath" in v
    )
    mounts = [f"/{name}" for name in volumes]
    (prepare,) = spec["initContainers"]
    (reclaim,) = spec["containers"]
    for container in (prepare, reclaim):
        found = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert {name: found[name] for name in volumes} == {name: f"/{name}" for name in volumes}
    assert prepare["command"][3:] == [*mounts, "1000", "1000"]
    args = node_reclaim.parse(reclaim["command"][3:])
    assert args.roots == [Path(m) for m in mounts]
    assert node_reclaim.node_paths(args.roots, args.node_paths) == {
        Path(f"/{name}"): Path(path) for name, path in volumes.items()
    }, "each mount point's logs name the node path it is mounted from"


def test_a_policy_of_node_cache_path_alone_renders_one_volume_as_before(tmp_path: Path) -> None:
    for values in ([], ["--set=policy.nodePaths={/var/cache/shardcache}"]):
        spec = pod_spec(node_cache(tmp_path, *values))
        assert node_path_volumes(spec) == {"node-cache": "/var/cache/shardcache"}
        (reclaim,) = spec["containers"]
        assert reclaim["command"][3:] == [
            "/node-cache",
            "--node-path=/var/cache/shardcache",
            "--interval-seconds=600",
        ]


def test_without_prepare_no_node_path_is_mounted_anywhere(tmp_path: Path) -> None:
    objects = node_cache(
        tmp_path,
        "--set=nodeCache.prepare=false",
        "--set=policy.nodePaths={/var/cache/shardcache,/mnt/a}",
    )
    assert objects == {}


def test_with_reclaim_off_every_node_path_is_still_prepared(tmp_path: Path) -> None:
    spec = pod_spec(node_cache(
        tmp_path, "--set=nodeCache.reclaim.enabled=false",
        "--set=policy.nodePaths={/var/cache/shardcache,/mnt/a}",
    ))  # fmt: skip
    assert node_path_volumes(spec) == {
        "node-cache": "/var/cache/shardcache",
        "node-cache-1": "/mnt/a",
    }
    (prepare,) = spec["initContainers"]
    assert prepare["command"][3:5] == ["/node-cache", "/node-cache-1"]
    (idle,) = spec["containers"]
    assert "volumeMounts" not in idle


def test_the_prepare_command_goes_on_past_a_node_path_that_fails_and_names_it(
    tmp_path: Path,
) -> None:
    """The rendered init container's program, run here over stand-ins for the mount
    points: a missing one and a file are said, each by its path, the run fails (so the
    pod does not start) and a directory already right after them is left as it is."""
    spec = pod_spec(
        node_cache(tmp_path, "--set=policy.nodePaths={/var/cache/shardcache,/mnt/a,/mnt/b}")
    )
    (prepare,) = spec["initContainers"]
    python, flag, program = prepare["command"][:3]
    assert (python, flag) == ("python3", "-c")
    missing, file, right = tmp_path / "missing", tmp_path / "file", tmp_path / "right"
    file.write_text("")
    right.mkdir()
    right.chmod(0o2770)
    before = os.stat(right)
    uid, gid = str(os.getuid()), str(os.getgid())
    result = subprocess.run(
        [sys.executable, flag, program, str(missing), str(file), str(right), uid, gid],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"node cache prepare: {missing} could not be prepared"), lines
    assert "No such file or directory" in lines[0]
    assert lines[1].startswith(f"node cache prepare: {file} could not be prepared"), lines
    assert "not a directory" in lines[1]
    assert lines[2] == (
        f"node cache prepare: failed for {missing}, {file}; the other node paths were prepared"
    )
    assert os.stat(right) == before
