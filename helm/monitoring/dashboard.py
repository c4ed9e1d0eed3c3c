"""Generate the chart's Grafana dashboard (helm/shardcache/dashboards/shardcache.json).

The dashboard is code, not a hand-edited export: every panel is one PromQL query over
the metrics the sidecars and the operator export (docs/monitoring.md) and the recording
rules of the chart's PrometheusRule (templates/monitoring.yaml), so a renamed metric is
a change here and a failing test, not a blank panel found in production.
tests/integration/test_prometheus.py asks a real Prometheus every query in `PANELS`;
tests/unit/test_dashboard.py checks the committed JSON equals `render()`.

    python helm/monitoring/dashboard.py          # rewrite the committed JSON
    python helm/monitoring/dashboard.py --check  # exit 1 if it differs

Standard library only: the chart is built without the project's virtual environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent.parent / "shardcache" / "dashboards" / "shardcache.json"
UID = "shardcache"
#: Grafana's dashboard JSON schema version this layout is written for.
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    #: PromQL; `$namespace` is the dashboard's namespace variable (a regex).
    query: str
    legend: str
    unit: str
    description: str
    kind: str = "timeseries"


PANELS: tuple[Panel, ...] = (
    Panel(
        "Data stall fraction by pod and rank",
        'shardcache:data_stall_fraction:rate5m{namespace=~"$namespace"}',
        "{{namespace}}/{{pod}} rank {{rank}}",
        "percentunit",
        "Share of the training loop's time spent waiting for a batch (client-measured, "
        "reported through the sidecar). Near 0: data is never the bottleneck.",
    ),
    Panel(
        "Recent stall fraction by reader",
        'shardcache_reader_stall_fraction{namespace=~"$namespace"}',
        "{{namespace}}/{{pod}} rank {{rank}}",
        "percentunit",
        "The same over about each reader's last 20 batches: what the DataStarved "
        "condition and the data-stall alert look at.",
    ),
    Panel(
        "Prefetch depth by reader",
        'shardcache_prefetch_depth{namespace=~"$namespace"}',
        "{{namespace}}/{{pod}} rank {{rank}}",
        "none",
        "Shards the sidecar reads ahead of each reader: the configured depth, deeper while "
        "the reader waits on cold shards (prefetch.adaptive, up to prefetch.maxDepth).",
    ),
    Panel(
        "Cache hit ratio by tier",
        'shardcache:cache_hit_ratio:rate5m{namespace=~"$namespace"}',
        "{{namespace}}/{{pod}} {{tier}}",
        "percentunit",
        "Lookups served from the tier over all lookups of it.",
    ),
    Panel(
        "Source errors",
        'shardcache:source_errors:rate5m{namespace=~"$namespace"}',
        "{{namespace}}/{{pod}}",
        "reqps",
        "Source reads that failed after the sidecar's retries, per second: shard fetches, "
        "and manifest resolutions at start-up (shardcache_source_errors_total by op).",
    ),
    Panel(
        "Bytes fetched from the object store",
        'sum by (namespace, pod) (rate(shardcache_source_fetched_bytes_total{namespace=~"$namespace"}[5m]))',
        "{{namespace}}/{{pod}}",
        "Bps",
        "Read throughput from the source; cold caches and evictions raise it.",
    ),
    Panel(
        "Shard fetch latency p95",
        "histogram_quantile(0.95, sum by (le) "
        '(rate(shardcache_source_fetch_duration_seconds_bucket{namespace=~"$namespace"}[5m])))',
        "p95",
        "s",
        "Time to fetch one shard from the object store, retries included.",
    ),
    Panel(
        "Cache resident bytes by tier",
        'sum by (namespace, pod, tier) (shardcache_cache_resident_bytes{namespace=~"$namespace"})',
        "{{namespace}}/{{pod}} {{tier}}",
        "bytes",
        "What each tier holds; compare with its limit.",
    ),
    Panel(
        "Sample windows / memory tier limit",
        'max by (namespace, pod) (shardcache_sample_windows_bytes{namespace=~"$namespace"}) '
        "/ max by (namespace, pod) "
        '(shardcache_cache_limit_bytes{tier="memory", namespace=~"$namespace"})',
        "{{namespace}}/{{pod}}",
        "percentunit",
        "What the sample-mode readers' current and next windows take of the memory tier; "
        "above 100% their reads fail: raise spec.cache.memory or lower spec.sharding.window.",
    ),
    # Beside the windows panel and below resident bytes by tier: the memory tier's
    # other way of running out (what ShardcacheMemoryVolumeCycle alerts on).
    Panel(
        "Memory volume cycles (15m)",
        "sum by (namespace, pod, container) "
        '(increase(shardcache_memory_volume_cycles_total{namespace=~"$namespace"}[15m]))',
        "{{namespace}}/{{pod}} {{container}}",
        "none",
        "Acquires that failed because the readers held, mapped, the shards the memory "
        "volume lacked room for (ShardcacheMemoryVolumeCycle fires above 0): raise "
        "spec.cache.memory, run fewer ranks on the node, or let go of held batches; "
        "/v1/status stats.last_volume_cycle names what was missing (docs/faults.md).",
    ),
    Panel(
        "Sidecars ready",
        'sum(shardcache_ready{namespace=~"$namespace"})',
        "ready",
        "none",
        "Sidecars whose /readyz answers 200.",
        kind="stat",
    ),
    Panel(
        "DatasetMounts by phase",
        "max by (phase) (shardcache_operator_datasetmounts)",
        "{{phase}}",
        "none",
        "Counted by the active operator replica.",
    ),
    Panel(
        "DatasetMounts not Ready",
        "count(shardcache_operator_datasetmount_ready == 0) or vector(0)",
        "not ready",
        "none",
        "Mounts whose manifest is not resolved and pinned: their pods are refused.",
        kind="stat",
    ),
    Panel(
        "Operator source errors",
        # Reasons are open-ended, so no series exists before the first error: 0 then.
        "sum by (reason) (rate(shardcache_operator_source_errors_total[5m])) or on () vector(0)",
        "{{reason}}",
        "reqps",
        "Manifest resolutions that failed, by reason.",
    ),
    Panel(
        "Admission reviews",
        "sum by (result) (rate(shardcache_operator_admission_reviews_total[5m]))",
        "{{result}}",
        "reqps",
        "Pods the webhook saw, by what it did.",
    ),
)

#: Panels per row of the grid (24 units wide).
PER_ROW = 2


def _panel(index: int, panel: Panel) -> dict[str, Any]:
    width = 24 // PER_ROW
    height = 8
    return {
        "id": index + 1,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {
            "h": height,
            "w": width,
            "x": (index % PER_ROW) * width,
            "y": (index // PER_ROW) * height,
        },
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
        if panel.kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        "targets": [
            {
                "refId": "A",
                "datasource": DATASOURCE,
                "expr": panel.query,
                "legendFormat": panel.legend,
            }
        ],
    }


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    return {
        "uid": UID,
        "title": "shardcache",
        "description": "Dataset cache sidecars and the shardcache operator (generated by "
        "helm/monitoring/dashboard.py; do not edit by hand).",
        "tags": ["shardcache"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": False,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                },
                {
                    "name": "namespace",
                    "label": "Namespace",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": "label_values(shardcache_ready, namespace)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                },
            ]
        },
        "panels": [_panel(i, p) for i, p in enumerate(PANELS)],
    }


def render() -> str:
    """The committed file's exact text."""
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the file differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} differs from the generator: run python {__file__}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
