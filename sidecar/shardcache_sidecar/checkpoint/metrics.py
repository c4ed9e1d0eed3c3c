"""Prometheus metrics of the checkpoint agent, and the hooks the agent calls.

The transfer code calls an `Observer`; `NullObserver` is the default (laptops, tests),
`Metrics` maps the hooks to Prometheus series in the sidecar's registry.
"""

from __future__ import annotations

import threading
import time
from typing import Literal, Protocol

import prometheus_client as prom

Direction = Literal["upload", "download", "reused"]


class Observer(Protocol):
    def transferred(self, direction: Direction, nbytes: int) -> None: ...

    def file_started(self) -> None: ...

    def file_finished(self) -> None: ...

    def published(self, step: int, seconds: float, created_at: float) -> None: ...

    def upload_failed(self, step: int) -> None: ...

    def restored(self, step: int | None, seconds: float, created_at: float | None) -> None: ...


class NullObserver:
    def transferred(self, direction: Direction, nbytes: int) -> None:
        pass

    def file_started(self) -> None:
        pass

    def file_finished(self) -> None:
        pass

    def published(self, step: int, seconds: float, created_at: float) -> None:
        pass

    def upload_failed(self, step: int) -> None:
        pass

    def restored(self, step: int | None, seconds: float, created_at: float | None) -> None:
        pass


class Metrics:
    """The agent's series, registered in `registry` (the sidecar's)."""

    def __init__(self, registry: prom.CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self._last_created: float | None = None
        self.bytes = prom.Counter(
            "shardcache_checkpoint_bytes",
            "Checkpoint bytes moved, by direction (upload, download, reused from the node).",
            ["direction"],
            registry=registry,
        )
        self.upload_seconds = prom.Histogram(
            "shardcache_checkpoint_upload_duration_seconds",
            "Seconds from picking up a commit to publishing its manifest.",
            buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=registry,
        )
        self.restore_seconds = prom.Gauge(
            "shardcache_checkpoint_restore_duration_seconds",
            "Seconds the restore at start took.",
            registry=registry,
        )
        self.in_flight = prom.Gauge(
            "shardcache_checkpoint_uploads_in_flight",
            "Checkpoint files being uploaded right now.",
            registry=registry,
        )
        self.failures = prom.Counter(
            "shardcache_checkpoint_upload_failures",
            "Checkpoint uploads that failed (retried later when the store failed).",
            registry=registry,
        )
        self.last_step = prom.Gauge(
            "shardcache_checkpoint_last_committed_step",
            "Step of the newest checkpoint published in the object store (-1: none yet).",
            registry=registry,
        )
        self.last_step.set(-1)
        self.age = prom.Gauge(
            "shardcache_checkpoint_age_seconds",
            "Seconds since the newest published checkpoint was committed (-1: none yet).",
            registry=registry,
        )
        self.age.set_function(self._age)

    def _age(self) -> float:
        with self._lock:
            return -1.0 if self._last_created is None else time.time() - self._last_created

    def transferred(self, direction: Direction, nbytes: int) -> None:
        self.bytes.labels(direction).inc(nbytes)

    def file_started(self) -> None:
        self.in_flight.inc()

    def file_finished(self) -> None:
        self.in_flight.dec()

    def published(self, step: int, seconds: float, created_at: float) -> None:
        self.upload_seconds.observe(seconds)
        self._newest(step, created_at)

    def upload_failed(self, step: int) -> None:
        self.failures.inc()

    def restored(self, step: int | None, seconds: float, created_at: float | None) -> None:
        self.restore_seconds.set(seconds)
        if step is not None and created_at is not None:
            self._newest(step, created_at)

    def _newest(self, step: int, created_at: float) -> None:
        with self._lock:
            if self._last_created is None or created_at >= self._last_created:
                self._last_created = created_at
                self.last_step.set(step)
