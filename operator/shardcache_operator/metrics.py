"""Prometheus metrics of the operator, on their own registry.

Names follow the Prometheus conventions: `shardcache_operator_` prefix, base units
(`_seconds`), `_total` on counters, and labels with bounded values only (phases,
results, reasons) except the per-DatasetMount gauge, which has one series per object.
"""

from __future__ import annotations

import contextlib

import prometheus_client

from shardcache_operator import status

REGISTRY = prometheus_client.CollectorRegistry(auto_describe=True)

RECONCILE_TOTAL = prometheus_client.Counter(
    "shardcache_operator_reconcile_total",
    "DatasetMount reconciliations, by resulting phase.",
    ["phase"],
    registry=REGISTRY,
)
RECONCILE_DURATION = prometheus_client.Histogram(
    "shardcache_operator_reconcile_duration_seconds",
    "Time to reconcile one DatasetMount, manifest resolution included.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
    registry=REGISTRY,
)
SOURCE_ERRORS_TOTAL = prometheus_client.Counter(
    "shardcache_operator_source_errors_total",
    "Failed manifest resolutions, by condition reason.",
    ["reason"],
    registry=REGISTRY,
)
DATASETMOUNTS = prometheus_client.Gauge(
    "shardcache_operator_datasetmounts",
    "DatasetMounts known to this replica, by phase.",
    ["phase"],
    registry=REGISTRY,
)
ATTACHED_PODS = prometheus_client.Gauge(
    "shardcache_operator_attached_pods",
    "Unfinished pods labelled with a DatasetMount.",
    ["namespace", "datasetmount"],
    registry=REGISTRY,
)
ADMISSION_TOTAL = prometheus_client.Counter(
    "shardcache_operator_admission_reviews_total",
    "Pod admission reviews, by result: injected, unchanged, refused.",
    ["result"],
    registry=REGISTRY,
)
ADMISSION_DURATION = prometheus_client.Histogram(
    "shardcache_operator_admission_duration_seconds",
    "Time to answer one pod admission review, DatasetMount reads included.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)
UP = prometheus_client.Gauge(
    "shardcache_operator_up",
    "1 while the operator's event loop answers.",
    registry=REGISTRY,
)


class PhaseBook:
    """Phase of each DatasetMount, so the per-phase gauge can be recomputed exactly."""

    def __init__(self) -> None:
        self._phases: dict[tuple[str, str], str] = {}

    def set(self, namespace: str, name: str, phase: str | None) -> None:
        """Record a phase; None forgets the object (deleted) and its pod gauge."""
        if phase is None:
            self._phases.pop((namespace, name), None)
            with contextlib.suppress(KeyError):
                ATTACHED_PODS.remove(namespace, name)
        else:
            self._phases[(namespace, name)] = phase
        counts = dict.fromkeys(status.PHASES, 0)
        for known in self._phases.values():
            counts[known] = counts.get(known, 0) + 1
        for each, count in counts.items():
            DATASETMOUNTS.labels(phase=each).set(count)


PHASES = PhaseBook()


def exposition() -> tuple[bytes, str]:
    """The text exposition of every operator metric and its content type."""
    UP.set(1)
    return prometheus_client.generate_latest(REGISTRY), prometheus_client.CONTENT_TYPE_LATEST
