"""Prometheus metrics of the operator, one registry per `Metrics` object.

The operator's `context.Context` holds one `Metrics` (no module globals), as the
sidecar's does, so tests build fresh registries and several operators can share a
process. Names follow the Prometheus conventions: `shardcache_operator_` prefix, base
units (`_seconds`), `_total` on counters, and labels with bounded values only (phases,
results, reasons) except the per-DatasetMount gauge, which has one series per object.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

import prometheus_client

from shardcache_operator import status

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
# Reconciles list a bucket: milliseconds for a kept pin, minutes for a large dataset.
RECONCILE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Admission reviews answer within the webhook's 10 s timeout or fail the pod.
ADMISSION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """Every operator metric, on its own registry."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self.reconcile_total = prometheus_client.Counter(
            "shardcache_operator_reconcile_total",
            "DatasetMount reconciliations, by resulting phase.",
            ["phase"],
            registry=self.registry,
        )
        self.reconcile_duration = prometheus_client.Histogram(
            "shardcache_operator_reconcile_duration_seconds",
            "Time to reconcile one DatasetMount, manifest resolution included.",
            buckets=RECONCILE_BUCKETS,
            registry=self.registry,
        )
        self.source_errors_total = prometheus_client.Counter(
            "shardcache_operator_source_errors_total",
            "Failed reconciles and source checks, by condition reason: the store's "
            "failures, and the Secret, policy, busy and memory ones too.",
            ["reason"],
            registry=self.registry,
        )
        self.manifest_looks_total = prometheus_client.Counter(
            "shardcache_operator_manifest_looks_total",
            "Looks at whether a pin a Ready mount keeps is handed to its sidecars "
            "(manifest_backfill), by what was found or done.",
            ["result"],
            registry=self.registry,
        )
        self.datasetmounts = prometheus_client.Gauge(
            "shardcache_operator_datasetmounts",
            "DatasetMounts known to this replica, by phase.",
            ["phase"],
            registry=self.registry,
        )
        self.datasetmount_ready = prometheus_client.Gauge(
            "shardcache_operator_datasetmount_ready",
            "1 when the DatasetMount is Ready, 0 in any other phase (the not-Ready alert).",
            ["namespace", "datasetmount"],
            registry=self.registry,
        )
        self.attached_pods = prometheus_client.Gauge(
            "shardcache_operator_attached_pods",
            "Unfinished pods labelled with a DatasetMount.",
            ["namespace", "datasetmount"],
            registry=self.registry,
        )
        self.pods_on_older_pin = prometheus_client.Gauge(
            "shardcache_operator_pods_on_older_pin",
            "Unfinished pods of a DatasetMount whose sidecar reads another digest than the "
            "mount pins now: their job's, kept across a source edit, and pods injected "
            "without a recorded pin before the current one was resolved (docs/operator.md, "
            "Pinning). They go as those jobs finish.",
            ["namespace", "datasetmount"],
            registry=self.registry,
        )
        self.admission_total = prometheus_client.Counter(
            "shardcache_operator_admission_reviews_total",
            "Pod admission reviews, by result: injected, unchanged, refused.",
            ["result"],
            registry=self.registry,
        )
        self.admission_duration = prometheus_client.Histogram(
            "shardcache_operator_admission_duration_seconds",
            "Time to answer one pod admission review, DatasetMount reads included.",
            buckets=ADMISSION_BUCKETS,
            registry=self.registry,
        )
        self.admission_lookups_total = prometheus_client.Counter(
            "shardcache_operator_admission_lookups_total",
            "DatasetMounts looked up by the webhook, by where the answer came from: "
            "memory (the watch-fed index or an earlier read) or api (a read, once per mount "
            "the watch has not delivered yet).",
            ["source"],
            registry=self.registry,
        )
        self.pod_events_total = prometheus_client.Counter(
            "shardcache_operator_pod_events_total",
            "Pod watch events that reached the operator's handlers, by whether the pod "
            "carries the opt-in label (the watch's label selector keeps the others out).",
            ["opted_in"],
            registry=self.registry,
        )
        self.pod_count_writes_total = prometheus_client.Counter(
            "shardcache_operator_pod_count_writes_total",
            "status.attachedPods patches (one per changed count per coalescing interval).",
            registry=self.registry,
        )
        self.up = prometheus_client.Gauge(
            "shardcache_operator_up",
            "1 while the operator's event loop answers.",
            registry=self.registry,
        )
        # Present from the first scrape, so rate() has a zero to start from and the
        # dashboard's panels show 0 rather than nothing.
        for result in ("injected", "unchanged", "refused"):
            self.admission_total.labels(result=result)
        # Phase of each DatasetMount, so the per-phase gauge is recomputed exactly
        # rather than incremented and decremented on transitions kopf may replay.
        self._phases: dict[tuple[str, str], str] = {}

    def set_phase(self, namespace: str, name: str, phase: status.Phase | None) -> None:
        """Record a DatasetMount's phase; None forgets it (deleted) and its pod gauge."""
        self._record(namespace, name, phase)
        self._count_phases()

    def follow_phases(
        self,
        phases: Mapping[tuple[str, str], status.Phase | None],
        gone: Iterable[tuple[str, str]],
    ) -> None:
        """Set the phases the DatasetMount watch shows and forget the mounts it no longer
        shows, counting once: the pod-count writer's flush, on every replica (a standby
        never runs the handlers that call `set_phase`, and a mount whose finalizer went
        without the delete handler never has it forget the mount). None: the mount has
        no phase yet (its first reconcile); what was recorded for it stays."""
        for namespace, name in gone:
            self._record(namespace, name, None)
        for (namespace, name), phase in phases.items():
            if phase is not None:
                self._record(namespace, name, phase)
        self._count_phases()

    def _record(self, namespace: str, name: str, phase: status.Phase | None) -> None:
        if phase is None:
            self._phases.pop((namespace, name), None)
            with contextlib.suppress(KeyError):
                self.attached_pods.remove(namespace, name)
            with contextlib.suppress(KeyError):
                self.pods_on_older_pin.remove(namespace, name)
            with contextlib.suppress(KeyError):
                self.datasetmount_ready.remove(namespace, name)
        else:
            self._phases[(namespace, name)] = status.Phase(phase).value
            ready = 1 if phase == status.Phase.READY else 0
            self.datasetmount_ready.labels(namespace=namespace, datasetmount=name).set(ready)

    def _count_phases(self) -> None:
        counts = {each.value: 0 for each in status.Phase}
        for known in self._phases.values():
            counts[known] = counts.get(known, 0) + 1
        for each, count in counts.items():
            self.datasetmounts.labels(phase=each).set(count)

    def exposition(self) -> bytes:
        """The text exposition of every metric (content type `CONTENT_TYPE`)."""
        self.up.set(1)
        return prometheus_client.generate_latest(self.registry)
