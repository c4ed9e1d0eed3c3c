"""The chart's monitoring against a real Prometheus (issue 16, item 4).

Prometheus (built from its Go module by `make tools-prometheus`) scrapes a running
sidecar and the running operator, with the chart's rendered PrometheusRule loaded as
its rules. Then every panel of the generated dashboard must return data, and the
data-stall alert must fire for a rank whose loop only waits on data, and not for one
that computes between batches.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import yaml

import shardcache
from shardcache import plans, sidecar_client
from tests.e2e import harness
from tests.e2e.conftest import ReadyMount, Release
from tests.support import datasets, prometheus, waiting
from tests.support import stalls as stall_support
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.e2e

DASHBOARD = harness.REPO_ROOT / "helm" / "monitoring" / "dashboard.py"
SHARDS = [200, 150, 220, 180]
#: More rows than any shard: every batch of the slow rank waits for a shard.
BATCH_ROWS = 256
#: What the webhook names the first mount's sidecar container and port (pod_names).
SIDECAR_CONTAINER = "shardcache-train"
POD = "trainer-0"


def dashboard_panels() -> list[Any]:
    spec = importlib.util.spec_from_file_location("shardcache_dashboard", DASHBOARD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return list(module.PANELS)


MONITORING_ON = (
    "--set=monitoring.podMonitor.enabled=true",
    "--set=monitoring.rules.enabled=true",
    "--set=monitoring.dashboard.enabled=true",
)


def render(cluster: harness.Cluster, *values: str) -> list[dict[str, Any]]:
    result = cluster.run(
        "helm", "template", "rendered", str(harness.CHART_DIR),
        f"--namespace={harness.RELEASE_NAMESPACE}", f"--kube-version={harness.KUBE_VERSION}",
        *values,
    )  # fmt: skip
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_monitoring(cluster: harness.Cluster, *values: str) -> list[dict[str, Any]]:
    return render(cluster, *MONITORING_ON, *values)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(prometheus.binary("promtool")), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_promtool_accepts_the_charts_rules(e2e_cluster: harness.Cluster, tmp_path: Path) -> None:
    (rule,) = of_kind(render_monitoring(e2e_cluster), "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(prometheus.rule_file(rule)))
    check = promtool("check", "rules", str(path))
    assert check.returncode == 0, check.stdout + check.stderr
    rules = sum(len(group["rules"]) for group in rule["spec"]["groups"])
    assert f"SUCCESS: {rules} rules found" in check.stdout + check.stderr
    # The same check refuses a broken expression, so the pass above means something.
    broken = prometheus.rule_file(rule)
    broken["groups"][0]["rules"][0]["expr"] = "sum by (pod) (rate(x[5m])"
    path.write_text(yaml.safe_dump(broken))
    assert promtool("check", "rules", str(path)).returncode != 0


#: Counters of one pod over ten minutes, per second: 4 shards handed to readers from the
#: memory tier (a hit each), 3 of them cold (a miss each); 4 made resident from the
#: disk tier, 1 of them found there. (Per second: rates that are exact in binary.)
HIT_RATIO_TEST = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'shardcache_cache_hits_total{namespace="ml",pod="p",tier="memory"}'
        values: '0+240x10'
      - series: 'shardcache_cache_misses_total{namespace="ml",pod="p",tier="memory"}'
        values: '0+180x10'
      - series: 'shardcache_cache_hits_total{namespace="ml",pod="p",tier="disk"}'
        values: '0+60x10'
      - series: 'shardcache_cache_misses_total{namespace="ml",pod="p",tier="disk"}'
        values: '0+180x10'
    promql_expr_test:
      - expr: shardcache:cache_hit_ratio:rate5m
        eval_time: 10m
        exp_samples:
          - labels: 'shardcache:cache_hit_ratio:rate5m{namespace="ml",pod="p",tier="memory"}'
            value: 0.25
          - labels: 'shardcache:cache_hit_ratio:rate5m{namespace="ml",pod="p",tier="disk"}'
            value: 0.25
"""


def test_the_recorded_hit_ratio_is_the_share_of_lookups_each_tier_served(
    e2e_cluster: harness.Cluster, tmp_path: Path
) -> None:
    """A cold shard counts a memory-tier miss and, handed over, a hit: hits over hits
    plus misses read 4/7 where one shard in four was served warm."""
    (rule,) = of_kind(render_monitoring(e2e_cluster), "PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(prometheus.rule_file(rule)))
    (tmp_path / "test.yaml").write_text(HIT_RATIO_TEST)
    result = promtool("test", "rules", str(tmp_path / "test.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


#: A sidecar that cannot resolve its manifest (a failure every 30 s, op="manifest") and
#: never gets ready, beside one that is ready and fetches without errors.
NOT_READY_TEST = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'shardcache_ready{namespace="ml",pod="stuck",container="shardcache-train"}'
        values: '0x20'
      - series: 'shardcache_source_errors_total{namespace="ml",pod="stuck",op="manifest"}'
        values: '0+2x20'
      - series: 'shardcache_source_errors_total{namespace="ml",pod="stuck",op="fetch"}'
        values: '0x20'
      - series: 'shardcache_ready{namespace="ml",pod="fine",container="shardcache-train"}'
        values: '1x20'
      - series: 'shardcache_source_errors_total{namespace="ml",pod="fine",op="fetch"}'
        values: '0x20'
    promql_expr_test:
      - expr: shardcache:source_errors:rate5m{pod="stuck"}
        eval_time: 10m
        exp_samples:
          - labels: 'shardcache:source_errors:rate5m{namespace="ml",pod="stuck"}'
            value: 0.03333333333333333
    alert_rule_test:
      - alertname: ShardcacheSidecarNotReady
        eval_time: 5m
        exp_alerts: []
      - alertname: ShardcacheSidecarNotReady
        eval_time: 15m
        exp_alerts:
          - exp_labels:
              severity: warning
              namespace: ml
              pod: stuck
              container: shardcache-train
            exp_annotations:
              summary: "Sidecar ml/stuck (shardcache-train) is not ready"
              description: >-
                Its trainer does not start until it is. Its /readyz says why (the source
                unreachable, credentials refused, a digest mismatch, warm-up); see
                shardcache_source_errors_total{op="manifest"} and the sidecar's log.
"""


def test_a_sidecar_failing_its_source_at_start_up_is_counted_and_alerted_when_not_ready_for_long(
    e2e_cluster: harness.Cluster, tmp_path: Path
) -> None:
    """Manifest failures count in the recorded source-error rate, too slowly for
    ShardcacheSourceErrors (one per backoff); ShardcacheSidecarNotReady fires after its
    `for` (10m) for the stuck sidecar only."""
    (rule,) = of_kind(render_monitoring(e2e_cluster), "PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(prometheus.rule_file(rule)))
    (tmp_path / "test.yaml").write_text(NOT_READY_TEST)
    result = promtool("test", "rules", str(tmp_path / "test.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_monitoring_renders_two_podmonitors_and_the_generated_dashboard_only_when_enabled(
    e2e_cluster: harness.Cluster,
) -> None:
    docs = render_monitoring(e2e_cluster)
    (configmap,) = of_kind(docs, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    committed = (harness.CHART_DIR / "dashboards" / "shardcache.json").read_text()
    assert configmap["data"]["shardcache.json"] == committed.rstrip("\n")
    assert len(of_kind(docs, "PodMonitor")) == 2  # the operator's and the sidecars'
    defaults = render(e2e_cluster)
    assert not of_kind(defaults, "PodMonitor") and not of_kind(defaults, "PrometheusRule")


@pytest.fixture
def trainers(sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path) -> Iterator[Any]:
    """A sidecar and two ranks reading through it: rank 0 from storage too slow for it
    (every batch waits 50 ms for a shard) and doing nothing between batches, so it only
    ever waits on data; rank 1 at full speed, computing 200 ms per batch: far more than
    a warm or cold batch takes through the sidecar even on a loaded machine, so its
    waiting share stays well under the alert's threshold."""
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    proc = sidecar_factory(f"file://{root}")
    proc.start(wait="ready")
    stop = threading.Event()
    opened: list[shardcache.Dataset] = []
    threads = []
    for rank, step in ((0, lambda: None), (1, lambda: stop.wait(0.2))):
        shards = stall_support.SlowShards(
            sidecar_client.SidecarProvider.from_env(environ=proc.client_env())
        )
        if rank == 1:
            shards.slow.clear()
        ds = shardcache.Dataset(shards, plans.PlanParams(rank=rank, world_size=2))
        opened.append(ds)
        threads.append(
            threading.Thread(
                target=stall_support.read_until,
                args=(stop, ds, BATCH_ROWS, step),
                daemon=True,
            )
        )
    for thread in threads:
        thread.start()
    try:
        yield proc
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        for ds in opened:
            ds.close()


def test_prometheus_scrapes_sidecar_and_operator_every_panel_has_data_and_the_stall_alert_fires(
    e2e_cluster: harness.Cluster,
    operator: harness.Operator,
    release: Release,
    ready_mount: ReadyMount,
    trainers: SidecarProcess,
) -> None:
    if not isinstance(operator, harness.LocalOperator):
        pytest.skip("needs the operator's /metrics on loopback (the local e2e cluster)")
    (rule,) = of_kind(
        render_monitoring(
            e2e_cluster,
            # Short, so the alert fires within the test; the thresholds are the defaults.
            "--set=monitoring.rules.dataStall.for=2s",
        ),
        "PrometheusRule",
    )
    # Static targets with the labels the PodMonitors give: what the sidecars' monitor
    # keeps (the `shardcache` port) and the operator's (port `metrics`, honorLabels).
    targets = [
        prometheus.Target(
            "sidecars",
            f"{harness.HOST}:{trainers.port}",
            {"namespace": ready_mount.namespace, "pod": POD, "container": SIDECAR_CONTAINER},
        ),
        prometheus.Target(
            "operator",
            f"{harness.HOST}:{operator.health_port}",
            {"namespace": release.namespace, "pod": "operator-0"},
            honor_labels=True,
        ),
    ]
    prom = prometheus.Prometheus(targets, prometheus.rule_file(rule))
    prom.start()
    try:
        waiting.wait_until(
            "both targets up", lambda: len(prom.targets_up()) == 2, describe=prom.logs
        )

        panels = dashboard_panels()

        def empty_panels() -> list[str]:
            return [p.title for p in panels if not prom.query(p.query.replace("$namespace", ".*"))]

        waiting.wait_until(
            "every dashboard panel's query to return data",
            lambda: not empty_panels(),
            describe=lambda: f"panels without data: {empty_panels()}",
        )
        wait = prom.query(f'shardcache_data_wait_seconds_total{{pod="{POD}",rank="0"}}')
        assert float(wait[0]["value"][1]) > 0

        def fractions() -> dict[str, float]:
            found = prom.query(f'shardcache:data_stall_fraction:rate5m{{pod="{POD}"}}')
            return {s["metric"]["rank"]: float(s["value"][1]) for s in found}

        # A rank's fraction is 0/0 (NaN) until two of its scrapes saw its counters grow:
        # the computing rank reports less often than the waiting one.
        waiting.wait_until(
            "a stall fraction (not NaN) for both ranks",
            lambda: len(f := fractions()) == 2 and not any(math.isnan(v) for v in f.values()),
            describe=lambda: f"fractions by rank: {fractions()}",
        )
        by_rank = fractions()
        assert by_rank["0"] > by_rank["1"], by_rank

        def firing() -> list[dict[str, Any]]:
            return [
                a
                for a in prom.alerts()
                if a["labels"]["alertname"] == "ShardcacheDataStall" and a["state"] == "firing"
            ]

        stalled = waiting.wait_until(
            "ShardcacheDataStall firing for rank 0", firing, describe=lambda: str(prom.alerts())
        )
        assert {(a["labels"]["pod"], a["labels"]["rank"]) for a in stalled} == {(POD, "0")}
        assert "waits on data" in stalled[0]["annotations"]["summary"]
    finally:
        prom.stop()
