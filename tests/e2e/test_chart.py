"""The Helm chart: lint, render, schema, CRDs from crds/, and a server-side dry run."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
from typing import Any

import kubernetes.client
import pytest
import yaml
from shardcache_operator import configuration, injection, webhook

from tests.e2e import harness
from tests.e2e.conftest import Release

pytestmark = pytest.mark.e2e

CRDS_DIR = harness.REPO_ROOT / "crds"
#: Values of each mode the chart supports (docs/e2e.md, "Webhook modes").
MODES: dict[str, list[str]] = {
    "default": [],
    "external-url": [
        "--set=webhook.url=https://127.0.0.1:9443/shardcache-inject",
        "--set=webhook.caBundle=Y2E=",
    ],
    "cert-manager": ["--set=webhook.certManager.enabled=true"],
    "namespaced": [
        "--set=operator.watchNamespaces={team-a,team-b}",
        "--set=rbac.secretNamespaces={team-a}",
        "--set=rbac.secretNames={s3-credentials}",
    ],
    "single-replica-no-peering": ["--set=peering.enabled=false", "--set=operator.replicas=1"],
    "monitoring": [
        "--set=monitoring.podMonitor.enabled=true",
        "--set=monitoring.rules.enabled=true",
        "--set=monitoring.dashboard.enabled=true",
        "--set=networkPolicy.enabled=true",
        "--set=networkPolicy.namespaces={team-a}",
    ],
    # Several node paths: the node-cache DaemonSet's hostPath volume of each, named by
    # its index (a DNS label) whatever the path's length and characters.
    "node-paths": [
        "--set=policy.nodePaths={/mnt/Cache_2/"
        + "a-rather-long-directory-name/" * 3
        + "shardcache,/var/cache/shardcache,/mnt/b}",
    ],
}


def render(cluster: harness.Cluster, *args: str, check: bool = True) -> str:
    result = cluster.run(
        "helm", "template", "rendered", str(harness.CHART_DIR),
        f"--namespace={harness.RELEASE_NAMESPACE}", f"--kube-version={harness.KUBE_VERSION}",
        *args, check=check,
    )  # fmt: skip
    return result.stdout if result.returncode == 0 else result.stderr


def documents(text: str) -> list[dict[str, object]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_helm_lint_is_clean_in_every_mode(e2e_cluster: harness.Cluster, mode: str) -> None:
    result = e2e_cluster.run(
        "helm", "lint", "--strict", str(harness.CHART_DIR),
        f"--kube-version={harness.KUBE_VERSION}", *MODES[mode],
    )  # fmt: skip
    assert "0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


def test_chart_crds_are_the_files_in_crds(e2e_cluster: harness.Cluster) -> None:
    """One source: the chart's crds/ is the repo's crds/, also inside the packaged chart."""
    assert (harness.CHART_DIR / "crds").resolve() == CRDS_DIR.resolve()
    # `helm template --include-crds` renders the CRDs helm installs, file by file.
    rendered = render(e2e_cluster, "--include-crds")
    crds = [d for d in documents(rendered) if d["kind"] == "CustomResourceDefinition"]
    expected = [
        doc for path in sorted(CRDS_DIR.glob("*.yaml")) for doc in documents(path.read_text())
    ]
    assert sorted(crds, key=json.dumps) == sorted(expected, key=json.dumps)
    package_dir = harness.helm_home() / "package"
    package_dir.mkdir(exist_ok=True)
    e2e_cluster.run("helm", "package", str(harness.CHART_DIR), f"--destination={package_dir}")
    archive = next(package_dir.glob("shardcache-*.tgz"))
    with tarfile.open(archive) as tar:
        packaged = {
            pathlib.PurePosixPath(m.name).name: tar.extractfile(m).read()
            for m in tar.getmembers()
            if pathlib.PurePosixPath(m.name).parent.name == "crds" and m.isfile()
        }
    archive.unlink()
    assert packaged == {p.name: p.read_bytes() for p in CRDS_DIR.glob("*.yaml")}


def test_values_schema_refuses_bad_values(e2e_cluster: harness.Cluster) -> None:
    cases = {
        "--set=webhook.failurePolicy=Sometimes": "failurePolicy",
        "--set=webhook.url=https://example.invalid/other-path": "url",
        "--set=webhook.url=https://127.0.0.1:9443/shardcache-inject": "caBundle",
        "--set=operator.replicas=2,peering.enabled=false": "replicas",
        "--set=operator.unknownKey=1": "unknownKey",
        "--set=rbac.secretNamespaces={Not_A_Namespace}": "secretNamespaces",
        # The node-cache DaemonSet's root init container chowns nodeCache.path on every
        # node: the CRD's nodePath pattern (no "/", no "." or ".." segment, no "//").
        "--set=nodeCache.path=/": "nodeCache/path",
        "--set=nodeCache.path=/var/cache/../../etc": "nodeCache/path",
        "--set=nodeCache.path=/var//cache": "nodeCache/path",
        "--set=nodeCache.path=/var/cache/": "nodeCache/path",
        "--set=policy.nodePaths={/var/cache/..}": "nodePaths",
    }
    for flag, named in cases.items():
        result = e2e_cluster.run(
            "helm", "template", "bad", str(harness.CHART_DIR),
            f"--kube-version={harness.KUBE_VERSION}", flag, check=False,
        )  # fmt: skip
        assert result.returncode != 0, f"{flag} was accepted"
        assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
        assert named in result.stderr, f"{flag}: {result.stderr}"


def map_values(values: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the non-empty maps in `values`, but those the templates copy
    whole (toYaml) instead of reading keys of."""
    whole = {
        "operator.resources", "webhook.objectSelector", "podSecurityContext",
        "securityContext", "monitoring.dashboard.labels", "uninstallGuard.resources",
        "nodeCache.reclaim.resources",
    }  # fmt: skip
    found = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in whole:
            found += [path, *map_values(value, f"{path}.")]
    return found


def test_values_of_an_older_chart_fail_with_what_to_do_not_a_nil_pointer(
    e2e_cluster: harness.Cluster,
) -> None:
    """`helm upgrade --reuse-values` keeps an older chart's values, which lack maps added
    since; every map the templates read is named, with the flag that helps."""
    defaults = yaml.safe_load((harness.CHART_DIR / "values.yaml").read_text())
    paths = map_values(defaults)
    assert {"nodeCache", "policy", "monitoring", "operator.settings"} <= set(paths)
    for path in paths:
        text = render(e2e_cluster, f"--set={path}=null", check=False)
        assert "nil pointer" not in text, f"{path}: {text}"
        if "values don't meet the specifications of the schema" in text:
            continue  # refused earlier, naming a key (peering: replicas need it)
        assert f"the values lack {path}" in text, f"{path}: {text}"
        assert "--reset-then-reuse-values" in text, text


def test_operator_replicas_are_spread_and_kept_through_voluntary_disruptions(
    e2e_cluster: harness.Cluster,
) -> None:
    """Both replicas serve a failurePolicy Fail webhook: a PodDisruptionBudget and a
    soft spread by node (defect 8), none with one replica, none when switched off."""
    rendered = documents(render(e2e_cluster))
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    (budget,) = [d for d in rendered if d["kind"] == "PodDisruptionBudget"]
    pod = deployment["spec"]["template"]  # type: ignore[index]
    assert budget["spec"] == {  # type: ignore[index]
        "minAvailable": 1,
        "selector": deployment["spec"]["selector"],  # type: ignore[index]
    }
    (spread,) = pod["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    single = documents(render(e2e_cluster, *MODES["single-replica-no-peering"]))
    assert not [d for d in single if d["kind"] == "PodDisruptionBudget"]
    off = documents(
        render(
            e2e_cluster,
            "--set=operator.spread.topologyKey=",
            "--set=operator.podDisruptionBudget.enabled=false",
        )
    )
    assert not [d for d in off if d["kind"] == "PodDisruptionBudget"]
    (plain,) = [d for d in off if d["kind"] == "Deployment"]
    assert "topologySpreadConstraints" not in plain["spec"]["template"]["spec"]  # type: ignore[index]
    refused = render(e2e_cluster, "--set=operator.podDisruptionBudget.minAvailable=2", check=False)
    assert "must be below operator.replicas (2)" in refused, refused


def test_node_cache_path_is_the_default_node_path_of_the_operator(
    e2e_cluster: harness.Cluster,
) -> None:
    """nodeCache.path is spec.cache.nodePath's default, as values.yaml says (defect 3):
    the operator gets it, and an allow-list without it is refused."""
    rendered = documents(render(e2e_cluster, "--set=nodeCache.path=/data/x"))
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]  # type: ignore[index]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SHARDCACHE_OPERATOR_DEFAULT_NODE_PATH"] == "/data/x"
    assert env["SHARDCACHE_OPERATOR_NODE_PATHS"] == "/data/x"
    settings = configuration.from_env({k: v for k, v in env.items() if v is not None})
    assert settings.policy().default_node_path == "/data/x"
    refused = render(e2e_cluster, "--set=policy.nodePaths={/mnt/a}", check=False)
    assert 'leaves out nodeCache.path "/var/cache/shardcache"' in refused, refused


def test_rbac_grants_secrets_only_where_asked(e2e_cluster: harness.Cluster) -> None:
    rendered = documents(render(e2e_cluster, *MODES["namespaced"]))
    by_kind: dict[str, list[dict[str, object]]] = {}
    for doc in rendered:
        by_kind.setdefault(str(doc["kind"]), []).append(doc)
    secret_rules = [
        (doc["metadata"], rule)
        for kind in ("ClusterRole", "Role")
        for doc in by_kind.get(kind, [])
        for rule in doc.get("rules", [])
        if "secrets" in rule["resources"]
    ]
    assert [
        (meta["namespace"], rule["verbs"], rule["resourceNames"]) for meta, rule in secret_rules
    ] == [("team-a", ["get"], ["s3-credentials"])]
    # Watching two namespaces: pods and DatasetMounts through Roles there, nothing cluster-wide
    # (but the node-cache reclaim's list of namespaces, its own service account's, and the
    # operator's get/list/watch of the two namespaces themselves).
    roles = {str(r["metadata"]["name"]).rsplit("-", 1)[-1]: r for r in by_kind["ClusterRole"]}  # type: ignore[index]
    cluster_role, node_cache = roles.pop("operator"), roles.pop("cache")
    assert not roles
    assert [r["resources"] for r in cluster_role["rules"]] == [
        ["customresourcedefinitions"], ["namespaces"],
    ]  # fmt: skip
    # The namespaces' UIDs key their node disk directories: only the watched ones, by name.
    assert cluster_role["rules"][1] == {
        "apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"],
        "resourceNames": ["team-a", "team-b"],
    }  # fmt: skip
    assert node_cache["rules"] == [
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list"]}
    ]
    assert sorted(r["metadata"]["namespace"] for r in by_kind["Role"]) == [
        "team-a", "team-a", "team-b",
    ]  # fmt: skip
    peerings = [(d["kind"], d["metadata"]["namespace"]) for d in by_kind["KopfPeering"]]
    assert peerings == [("KopfPeering", "team-a"), ("KopfPeering", "team-b")]


@pytest.mark.parametrize("mode", ["default", "external-url", "namespaced", "node-paths"])
def test_rendered_chart_passes_server_side_dry_run(
    e2e_cluster: harness.Cluster, release: Release, mode: str
) -> None:
    """Every rendered object is valid for the real API server (its CRDs are installed
    by the `release` fixture; namespaced mode's namespaces are the release's)."""
    args = list(MODES[mode])
    if mode == "namespaced":
        args = [
            f"--set=operator.watchNamespaces={{{release.secret_namespace}}}",
            f"--set=rbac.secretNamespaces={{{release.secret_namespace}}}",
            "--set=peering.name=dry-run",
        ]
    rendered = render(e2e_cluster, *args)
    kinds = sorted({str(doc["kind"]) for doc in documents(rendered)})
    assert "MutatingWebhookConfiguration" in kinds and "Deployment" in kinds, kinds
    result = e2e_cluster.run("kubectl", "apply", "--dry-run=server", "-f", "-", stdin=rendered)
    applied = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(applied) == len(documents(rendered)), result.stdout
    assert all("(server dry run)" in line for line in applied), result.stdout


def test_network_policy_admits_only_the_namespace_and_the_scrapers(
    e2e_cluster: harness.Cluster, release: Release
) -> None:
    """The optional NetworkPolicy, applied through the real API server (dry run)."""
    rendered = render(
        e2e_cluster,
        "--set=networkPolicy.enabled=true",
        f"--set=networkPolicy.namespaces={{{release.secret_namespace}}}",
        '--set-json=networkPolicy.metricsFrom=[{"namespaceSelector":{}}]',
        "--show-only=templates/networkpolicy.yaml",
    )
    (policy,) = documents(rendered)
    spec: Any = policy["spec"]
    assert spec["podSelector"]["matchExpressions"][0]["key"] == "shardcache.io/mount"
    same_namespace, operator, scrapers = spec["ingress"]
    assert same_namespace == {"from": [{"podSelector": {}}]}
    assert scrapers["ports"] == [{"protocol": "TCP", "port": 8470, "endPort": 8479}]
    # The operator's pods read the sidecars' stall fraction (DataStarved), on those ports.
    (peer,) = operator["from"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    ns_label = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
    assert ns_label == harness.RELEASE_NAMESPACE
    assert operator["ports"] == scrapers["ports"]
    result = e2e_cluster.run("kubectl", "apply", "--dry-run=server", "-f", "-", stdin=rendered)
    assert "networkpolicy" in result.stdout and "(server dry run)" in result.stdout
    # Off by default.
    assert "NetworkPolicy" not in {doc["kind"] for doc in documents(render(e2e_cluster))}


def test_notes_say_how_the_release_is_wired(e2e_cluster: harness.Cluster, release: Release) -> None:
    status = e2e_cluster.run(
        "helm", "status", release.name, f"--namespace={release.namespace}"
    ).stdout
    assert "external mode" in status or "chart-generated CA" in status, status
    assert f"may read Secrets (get only) in: {release.secret_namespace}" in status, status


def test_upgrade_keeps_the_chart_generated_ca(
    e2e_cluster: harness.Cluster, release: Release, admin: kubernetes.client.ApiClient
) -> None:
    """The chart looks up its TLS Secret, so an upgrade keeps the CA that running
    webhook configurations trust instead of generating a new one."""
    secret_name = f"{release.name}-webhook-tls"
    stored = kubernetes.client.CoreV1Api(admin).read_namespaced_secret(
        secret_name, release.namespace
    )
    result = e2e_cluster.run(
        "helm", "upgrade", release.name, str(harness.CHART_DIR),
        f"--namespace={release.namespace}", "--reuse-values", "--dry-run=server",
    )  # fmt: skip
    manifest = result.stdout.split("MANIFEST:", 1)[1].split("NOTES:", 1)[0]
    (rendered,) = [
        d for d in documents(manifest)
        if d["kind"] == "Secret" and d["metadata"]["name"] == secret_name
    ]  # fmt: skip
    assert rendered["data"] == stored.data


def test_installed_operator_deployment_is_available_under_its_service_account(
    admin: kubernetes.client.ApiClient, release: Release
) -> None:
    """kube-scheduler places the Deployment's pods on kwok's nodes and kwok reports them
    Running and Ready (no process runs: the tests run the operator locally)."""
    apps = kubernetes.client.AppsV1Api(admin)
    name = f"{release.name}-operator"
    # The chart's default (2) unless the provider's values say otherwise.
    replicas = release.values["operator"].get("replicas", 2)

    def available() -> int | None:
        status = apps.read_namespaced_deployment_status(name, release.namespace).status
        return status.available_replicas if status.available_replicas == replicas else None

    harness.wait_until(
        f"Deployment {name} with {replicas} available replicas", available, timeout=120
    )
    spec = apps.read_namespaced_deployment(name, release.namespace).spec.template.spec
    assert spec.service_account_name == release.service_account
    assert [v.secret.secret_name for v in spec.volumes if v.secret] == [
        f"{release.name}-webhook-tls"
    ]
    (container,) = spec.containers
    assert container.security_context.read_only_root_filesystem is True
    assert container.args == ["operator", "--log-level=INFO"]  # operator.logLevel, upper-cased


def test_node_cache_daemonset_prepares_the_sidecars_directory(
    e2e_cluster: harness.Cluster, tmp_path: pathlib.Path
) -> None:
    """The non-root sidecar cannot create its hostPath disk tier; the chart's DaemonSet
    makes the default node path its own, with root confined to an init container."""
    (daemonset,) = [d for d in documents(render(e2e_cluster)) if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]  # type: ignore[index]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "node-cache"]
    default_path = configuration.Settings().default_node_path
    assert volume["hostPath"] == {"path": default_path, "type": "DirectoryOrCreate"}
    (prepare,) = pod["initContainers"]
    assert prepare["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert prepare["securityContext"]["allowPrivilegeEscalation"] is False
    uid = injection.SidecarDefaults(image="x").run_as_user
    assert prepare["command"][-2:] == [str(uid), str(uid)]
    (reclaim,) = pod["containers"]  # nodeCache.reclaim (tests/unit/test_chart_node_cache_render.py)
    assert reclaim["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["automountServiceAccountToken"] is False
    # The command itself, run here as root on a stand-in for the node directory.
    node_dir = tmp_path / "node-cache"
    node_dir.mkdir(mode=0o755)
    argv = [*prepare["command"][:-3], str(node_dir), *prepare["command"][-2:]]
    subprocess.run([sys.executable, *argv[1:]], check=True)
    stat = os.stat(node_dir)
    # setgid and group-writable: the ns-<namespace> directories the kubelet makes in it
    # for the sidecars' subPath mounts are root's, with the sidecar's group.
    assert (stat.st_uid, stat.st_gid, stat.st_mode & 0o7777) == (uid, uid, 0o2770)
    # A restarted pod finds the directory prepared and leaves it alone.
    subprocess.run([sys.executable, *argv[1:]], check=True)
    assert os.stat(node_dir) == stat
    assert not [
        d
        for d in documents(render(e2e_cluster, "--set=nodeCache.prepare=false"))
        if d["kind"] == "DaemonSet"
    ]


def test_node_cache_prepare_sets_an_older_charts_directory_right_with_cap_chown_alone(
    e2e_cluster: harness.Cluster, tmp_path: pathlib.Path
) -> None:
    """An older chart made the node directory 0750, and the kubelet may have made an
    ns-<namespace> directory in it (root's, 0750) before the DaemonSet rolled: both are
    set right by root with CAP_CHOWN only (no CAP_FOWNER, no CAP_FSETID), as on a node,
    and a link there is never followed."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    (daemonset,) = [d for d in documents(render(e2e_cluster)) if d["kind"] == "DaemonSet"]
    (prepare,) = daemonset["spec"]["template"]["spec"]["initContainers"]  # type: ignore[index]
    uid = injection.SidecarDefaults(image="x").run_as_user
    node_dir = tmp_path / "node-cache"
    node_dir.mkdir()
    (node_dir / "ns-kubelet").mkdir(mode=0o750)  # root's, as the kubelet makes it
    (node_dir / "ns-sidecar").mkdir(mode=0o755)  # an older sidecar's own
    os.chown(node_dir / "ns-sidecar", uid, uid)
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    (node_dir / "ns-link").symlink_to(outside)
    os.chown(node_dir, uid, uid)
    node_dir.chmod(0o750)
    argv = [*prepare["command"][:-3], str(node_dir), *prepare["command"][-2:]]
    capabilities = ["--inh-caps=-all,+chown", "--bounding-set=-all,+chown", "--no-new-privs"]
    subprocess.run([setpriv, *capabilities, "--", sys.executable, *argv[1:]], check=True)

    def owner_and_mode(path: pathlib.Path) -> tuple[int, int, int]:
        st = os.lstat(path)
        return st.st_uid, st.st_gid, st.st_mode & 0o7777

    assert owner_and_mode(node_dir) == (uid, uid, 0o2770)
    assert owner_and_mode(node_dir / "ns-kubelet") == (0, uid, 0o2770)
    assert owner_and_mode(node_dir / "ns-sidecar") == (uid, uid, 0o755)
    assert owner_and_mode(outside) == (0, 0, 0o755)


def test_node_cache_prepare_prepares_every_node_path_and_names_one_that_fails(
    e2e_cluster: harness.Cluster, tmp_path: pathlib.Path
) -> None:
    """With several policy.nodePaths the init container is given every mount point: it
    prepares each (run here as root, as on a node), says one it cannot prepare by its
    path, prepares the ones after it all the same, and then fails."""
    rendered = render(e2e_cluster, *MODES["node-paths"])
    (daemonset,) = [d for d in documents(rendered) if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]  # type: ignore[index]
    (prepare,) = pod["initContainers"]
    assert prepare["command"][3:-2] == ["/node-cache", "/node-cache-1", "/node-cache-2"]
    uid = injection.SidecarDefaults(image="x").run_as_user
    missing, fresh = tmp_path / "missing", tmp_path / "fresh"
    fresh.mkdir(mode=0o755)  # as the kubelet makes a DirectoryOrCreate hostPath
    argv = [*prepare["command"][1:3], str(missing), str(fresh), *prepare["command"][-2:]]
    result = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1, result.stderr
    assert f"node cache prepare: {missing} could not be prepared" in result.stderr
    assert f"failed for {missing}; the other node paths were prepared" in result.stderr
    st = os.stat(fresh)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (uid, uid, 0o2770)


def test_webhook_sees_pod_updates_and_debug_containers_but_not_spec_free_updates(
    e2e_cluster: harness.Cluster,
) -> None:
    """CREATE injects; UPDATEs of the pod and of pods/ephemeralcontainers (kubectl
    debug) may not reach the injected sidecar; an UPDATE that leaves the spec alone is
    not sent at all, by the operator's own match condition."""
    (config,) = [
        d for d in documents(render(e2e_cluster)) if d["kind"] == "MutatingWebhookConfiguration"
    ]
    (hook,) = config["webhooks"]  # type: ignore[index]
    (rule,) = hook["rules"]
    assert rule["operations"] == ["CREATE", "UPDATE"]
    assert rule["resources"] == ["pods", "pods/ephemeralcontainers"]
    assert hook["matchConditions"] == list(webhook.MATCH_CONDITIONS)
    assert hook["objectSelector"] == {
        "matchExpressions": [{"key": injection.LABEL_MOUNT, "operator": "Exists"}]
    }
