"""The chart's operator Deployment and alert rules, rendered with `helm template` (no
cluster): nodeCache.uid reaches the webhook, every log level works, and the
ShardcacheCacheTierUnusable alert fires for an unusable tier (promtool)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardcache_operator import configuration, resolve_slots, webhook

from tests.support import prometheus, toolpaths

pytestmark = pytest.mark.unit

CHART = toolpaths.REPO_ROOT / "helm" / "shardcache"


def helm_template(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    helm = toolpaths.tool_binary("helm", "HELM_VERSION", "helm")
    home = {k: str(tmp_path / k) for k in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")}
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"} | home
    return subprocess.run(
        [str(helm), "template", "rel", str(CHART), "--namespace=rel-system", *args],
        capture_output=True, text=True, check=False, timeout=60, env=env,
    )  # fmt: skip


def rendered(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    result = helm_template(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def operator_container(tmp_path: Path, *args: str) -> dict[str, Any]:
    (deployment,) = [d for d in rendered(tmp_path, *args) if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def test_node_cache_uid_is_the_uid_the_webhook_injects(tmp_path: Path) -> None:
    container = operator_container(tmp_path, "--set=nodeCache.uid=1000,nodeCache.gid=1000")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SHARDCACHE_OPERATOR_SIDECAR_UID"] == "1000"
    settings = configuration.from_env({k: v for k, v in env.items() if v is not None})
    assert webhook.defaults_of(settings).run_as_user == 1000
    default = operator_container(tmp_path)
    env = {e["name"]: e.get("value") for e in default["env"]}
    assert env["SHARDCACHE_OPERATOR_SIDECAR_UID"] == str(configuration.Settings.sidecar_uid)


def test_the_resolve_memory_value_reaches_the_operator_and_a_bad_one_is_refused(
    tmp_path: Path,
) -> None:
    env = {e["name"]: e.get("value") for e in operator_container(tmp_path)["env"]}
    settings = configuration.from_env({k: v for k, v in env.items() if v is not None})
    assert settings.resolve_memory == configuration.Settings.resolve_memory
    raised = operator_container(tmp_path, "--set=operator.settings.resolveMemory=384Mi")
    env = {e["name"]: e.get("value") for e in raised["env"]}
    assert env["SHARDCACHE_OPERATOR_RESOLVE_MEMORY"] == "384Mi"
    assert (
        configuration.from_env({"SHARDCACHE_OPERATOR_RESOLVE_MEMORY": "384Mi"}).resolve_memory
        == 384 << 20
    )
    refused = helm_template(tmp_path, "--set=operator.settings.resolveMemory=lots")
    assert refused.returncode != 0
    assert "resolveMemory" in refused.stderr, refused.stderr


@pytest.mark.parametrize(
    ("value", "variable", "field", "given", "bad"),
    [
        ("resolveChildren", "RESOLVE_CHILDREN", "resolve_children", 3, ("-1", "lots")),
        ("readWorkers", "READ_WORKERS", "read_workers", 4, ("0", "lots")),
    ],
)
def test_a_count_of_processes_reaches_the_operator_and_a_bad_one_is_refused(
    tmp_path: Path, value: str, variable: str, field: str, given: int, bad: tuple[str, ...]
) -> None:
    env = {e["name"]: e.get("value") for e in operator_container(tmp_path)["env"]}
    settings = configuration.from_env({k: v for k, v in env.items() if v is not None})
    assert getattr(settings, field) == getattr(configuration.Settings, field)
    raised = operator_container(tmp_path, f"--set=operator.settings.{value}={given}")
    env = {e["name"]: e.get("value") for e in raised["env"]}
    assert env[f"SHARDCACHE_OPERATOR_{variable}"] == str(given)
    settings = configuration.from_env({k: v for k, v in env.items() if v is not None})
    assert getattr(settings, field) == given
    for refused_value in bad:
        refused = helm_template(tmp_path, f"--set=operator.settings.{value}={refused_value}")
        assert refused.returncode != 0
        assert value in refused.stderr, refused.stderr


def test_the_default_memory_limit_holds_the_operator_two_resolves_and_the_read_workers(
    tmp_path: Path,
) -> None:
    """At their worst (`resolveMemory` each), beside the operator's own reserve."""
    container = operator_container(tmp_path)
    limit = configuration.from_env(
        {"SHARDCACHE_OPERATOR_RESOLVE_MEMORY": container["resources"]["limits"]["memory"]}
    ).resolve_memory
    settings = configuration.from_env(
        {e["name"]: e["value"] for e in container["env"] if e.get("value") is not None}
    )
    children = resolve_slots.capacity_for(
        settings.resolve_children,
        memory_limit=limit,
        resolve_memory=settings.resolve_memory,
        read_workers=settings.read_workers,
    )
    assert children == resolve_slots.MIN_DEFAULT
    worst = (children + settings.read_workers) * settings.resolve_memory
    assert resolve_slots.OPERATOR_RESERVE + worst <= limit


def namespace_rules(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    """The rules on namespaces of the operator's ClusterRole."""
    (role,) = [
        d
        for d in rendered(tmp_path, *args)
        if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-operator")
    ]
    return [r for r in role["rules"] if "namespaces" in r["resources"]]


def test_the_operator_may_read_namespaces_for_the_uid_that_keys_their_node_directory(
    tmp_path: Path,
) -> None:
    """The webhook's namespace watch (`namespace_uids`): every namespace for a
    cluster-wide release, only the watched ones by name for a namespaced one."""
    (rule,) = namespace_rules(tmp_path)
    assert rule == {
        "apiGroups": [""],
        "resources": ["namespaces"],
        "verbs": ["get", "list", "watch"],
    }
    (rule,) = namespace_rules(tmp_path, "--set=operator.watchNamespaces={team-a,team-b}")
    assert rule["verbs"] == ["get", "list", "watch"]
    assert rule["resourceNames"] == ["team-a", "team-b"]


def test_a_gid_other_than_the_uid_is_refused(tmp_path: Path) -> None:
    """The webhook sets runAsGroup = runAsUser: a different gid would own the directory
    for a group the sidecar is not in."""
    result = helm_template(tmp_path, "--set=nodeCache.uid=1000")
    assert result.returncode != 0
    assert "nodeCache.gid 65532 differs from nodeCache.uid 1000" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("value", "flag"),
    [("debug", "DEBUG"), ("info", "INFO"), ("Warning", "WARNING"), ("ERROR", "ERROR")],
)
def test_every_log_level_reaches_the_operator_in_any_case(
    tmp_path: Path, value: str, flag: str
) -> None:
    container = operator_container(tmp_path, f"--set=operator.logLevel={value}")
    assert f"--log-level={flag}" in container["args"]


def test_an_unknown_log_level_is_refused_by_the_schema(tmp_path: Path) -> None:
    result = helm_template(tmp_path, "--set=operator.logLevel=verbose")
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert "logLevel" in result.stderr


#: A sidecar whose disk tier is unusable for 20 minutes (its memory tier is fine), beside
#: one whose disk tier is unusable for 2 minutes only (a node the DaemonSet reached late).
TIER_UNUSABLE_TEST = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'shardcache_cache_tier_usable{namespace="ml",pod="stuck",container="shardcache-train",tier="disk"}'
        values: '0x20'
      - series: 'shardcache_cache_tier_usable{namespace="ml",pod="stuck",container="shardcache-train",tier="memory"}'
        values: '1x20'
      - series: 'shardcache_cache_tier_usable{namespace="ml",pod="late",container="shardcache-train",tier="disk"}'
        values: '0 0 1x18'
    alert_rule_test:
      - alertname: ShardcacheCacheTierUnusable
        eval_time: 3m
        exp_alerts: []
      - alertname: ShardcacheCacheTierUnusable
        eval_time: 10m
        exp_alerts:
          - exp_labels:
              severity: warning
              namespace: ml
              pod: stuck
              container: shardcache-train
              tier: disk
            exp_annotations:
              summary: "Sidecar ml/stuck (shardcache-train) cannot use its disk tier"
              description: >-
                Its /readyz `tiers` gate and its log name the directory, the UID/GID it runs
                as, the directory's owner and mode and the fix (owner nodeCache.uid, mode
                2770: docs/operator.md). It rechecks every 2 s and goes on once fixed.
"""


def test_an_unusable_tier_fires_its_alert_after_its_for_and_a_healed_one_never(
    tmp_path: Path,
) -> None:
    docs = rendered(tmp_path, "--set=monitoring.rules.enabled=true")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(prometheus.rule_file(rule)))
    (tmp_path / "test.yaml").write_text(TIER_UNUSABLE_TEST)
    promtool = prometheus.binary("promtool")
    check = subprocess.run(
        [str(promtool), "check", "rules", str(tmp_path / "rules.yaml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    result = subprocess.run(
        [str(promtool), "test", "rules", str(tmp_path / "test.yaml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


#: A sidecar whose readers failed on the memory volume once, at minute 3; one that never
#: did; one whose counter restarted from 0 with its sidecar (a reset is no failure).
VOLUME_CYCLE_TEST = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'shardcache_memory_volume_cycles_total{namespace="ml",pod="full",container="shardcache-train"}'
        values: '0 0 0 1x40'
      - series: 'shardcache_memory_volume_cycles_total{namespace="ml",pod="fine",container="shardcache-train"}'
        values: '0x43'
      - series: 'shardcache_memory_volume_cycles_total{namespace="ml",pod="restarted",container="shardcache-train"}'
        values: '2x5 0x38'
    alert_rule_test:
      - alertname: ShardcacheMemoryVolumeCycle
        eval_time: 2m
        exp_alerts: []
      - alertname: ShardcacheMemoryVolumeCycle
        eval_time: 5m
        exp_alerts:
          - exp_labels:
              severity: warning
              namespace: ml
              pod: full
              container: shardcache-train
            exp_annotations:
              summary: "Readers of sidecar ml/full (shardcache-train) failed on a full memory volume they hold themselves"
              description: >-
                The ranks keep shards the tier evicted mapped (a batch they hold while asking
                for the next) beyond what the run volume has room for. /v1/status
                stats.last_volume_cycle names the volume, what they hold and the size that
                serves them: raise spec.cache.memory, run fewer ranks on the node, or let go
                of held batches (docs/faults.md).
      - alertname: ShardcacheMemoryVolumeCycle
        eval_time: 40m
        exp_alerts: []
"""


def test_a_volume_cycle_alerts_at_once_and_clears_when_none_failed_for_15m(
    tmp_path: Path,
) -> None:
    docs = rendered(tmp_path, "--set=monitoring.rules.enabled=true")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(prometheus.rule_file(rule)))
    (tmp_path / "test.yaml").write_text(VOLUME_CYCLE_TEST)
    result = subprocess.run(
        [str(prometheus.binary("promtool")), "test", "rules", str(tmp_path / "test.yaml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_policy_source_endpoints_reach_the_operator_as_its_list(tmp_path: Path) -> None:
    env = {e["name"]: e.get("value") for e in operator_container(tmp_path)["env"]}
    assert env["SHARDCACHE_OPERATOR_SOURCE_ENDPOINTS"] == ""
    assert configuration.from_env(env).source_endpoints == ()
    container = operator_container(
        tmp_path,
        "--set=policy.sourceEndpoints={https://minio.storage.svc:9000,https://*.s3.example}",
    )
    env = {e["name"]: e.get("value") for e in container["env"]}
    settings = configuration.from_env(env)
    assert [str(origin) for origin in settings.source_endpoints] == [
        "https://minio.storage.svc:9000",
        "https://*.s3.example",
    ]


@pytest.mark.parametrize(
    "entry",
    ["ftp://store.example", "store.example:9000", "https://store.example/bucket",
     "https://user:pw@store.example", "https://store.example:9000?x", "https://(.*).example"],
)  # fmt: skip
def test_the_values_schema_refuses_a_source_endpoint_that_is_not_an_origin(
    tmp_path: Path, entry: str
) -> None:
    good = json.dumps("https://store.example:9000")
    assert helm_template(tmp_path, f"--set-json=policy.sourceEndpoints=[{good}]").returncode == 0
    result = helm_template(
        tmp_path, f"--set-json=policy.sourceEndpoints=[{good},{json.dumps(entry)}]"
    )
    assert result.returncode != 0
    assert "/policy/sourceEndpoints/1" in result.stderr and "pattern" in result.stderr, (
        result.stderr
    )


def test_policy_source_endpoints_take_a_namenode_for_hdfs_sources(tmp_path: Path) -> None:
    """hdfs:// and viewfs:// sources connect to a namenode, listed by its own scheme."""
    container = operator_container(
        tmp_path, "--set=policy.sourceEndpoints={hdfs://namenode.hadoop.svc,viewfs://cluster}"
    )
    env = {e["name"]: e.get("value") for e in container["env"]}
    settings = configuration.from_env(env)
    assert [str(origin) for origin in settings.source_endpoints] == [
        "hdfs://namenode.hadoop.svc",
        "viewfs://cluster",
    ]
    assert [origin.port for origin in settings.source_endpoints] == [8020, 8020]


def configmap_grants(docs: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, namespace, rule) of every rendered (Cluster)Role rule that names ConfigMaps."""
    return [
        (doc["kind"], doc["metadata"].get("namespace", ""), rule)
        for doc in docs
        if doc["kind"] in ("Role", "ClusterRole")
        for rule in doc.get("rules") or []
        if "configmaps" in rule.get("resources", []) or "*" in rule.get("resources", [])
    ]


def test_manifest_namespaces_grant_configmap_writes_there_and_reach_the_operator(
    tmp_path: Path,
) -> None:
    """rbac.manifestNamespaces: a Role per namespace with ConfigMap get, create, update
    and delete (never list or watch) bound to the operator's ServiceAccount, and the
    same list in its setting, so the webhook mounts the handed manifests there alone."""
    docs = rendered(tmp_path, "--set=rbac.manifestNamespaces={team-a,team-b}")
    rule = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "verbs": ["get", "create", "update", "delete"],
    }
    assert configmap_grants(docs) == [("Role", "team-a", rule), ("Role", "team-b", rule)]
    bindings = [
        d
        for d in docs
        if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "rel-shardcache-manifest-writer"
    ]
    assert [b["metadata"]["namespace"] for b in bindings] == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "rel-shardcache-manifest-writer",
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "rel-shardcache", "namespace": "rel-system"}
        ]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SHARDCACHE_OPERATOR_MANIFEST_NAMESPACES"] == "team-a,team-b"
    settings = configuration.from_env({k: v for k, v in env.items() if v is not None})
    assert settings.manifest_namespaces == ("team-a", "team-b")
    assert webhook.defaults_of(settings).manifest_namespaces == ("team-a", "team-b")


def test_by_default_the_operator_has_no_configmap_access_and_hands_no_manifests(
    tmp_path: Path,
) -> None:
    docs = rendered(tmp_path, "--set=rbac.secretNamespaces={team-a}")
    assert configmap_grants(docs) == []
    env = {e["name"]: e.get("value") for e in operator_container(tmp_path)["env"]}
    settings = configuration.from_env({k: v for k, v in env.items() if v is not None})
    assert settings.manifest_namespaces == ()
    refused = helm_template(tmp_path, "--set=rbac.manifestNamespaces={Team_A}")
    assert refused.returncode != 0
    assert "/rbac/manifestNamespaces/0" in refused.stderr, refused.stderr
