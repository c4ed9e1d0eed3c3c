"""The seam between `Dataset` and where shards come from.

A `ShardProvider` hands out shards, already decoded to uncompressed Arrow IPC files in
the memory tier, under a lease that keeps them resident while the trainer reads them.
Two implementations: embedded (the cache runs in this process) and sidecar (the
sidecar runs it and the trainer talks to it over the control socket). The protocol is
per shard, never per sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from shardcache import manifests, plans, stalls


class ShardLease(Protocol):
    """A shard resident in the memory tier, pinned until `release()`."""

    @property
    def path(self) -> Path:
        """An uncompressed Arrow IPC file (one record batch) the caller may memory-map."""
        ...

    def release(self) -> None:
        """Unpin the shard. Idempotent. Mappings already made stay valid after release."""
        ...


class ShardProvider(Protocol):
    @property
    def manifest(self) -> manifests.Manifest: ...

    def open_reader(self, params: plans.PlanParams, *, position: int) -> str:
        """Register a reader (its plan) so the prefetcher can follow it; returns its id."""
        ...

    def acquire(self, reader_id: str, shard: int, *, epoch: int, position: int) -> ShardLease:
        """Block until `shard` is resident; `epoch`/`position` tell the prefetcher where
        the reader is (samples consumed in the epoch), so it reads ahead from there."""
        ...

    def close_reader(self, reader_id: str) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class StallReporter(Protocol):
    """A provider that passes a reader's data-stall totals on (the sidecar exports them,
    docs/monitoring.md). `Dataset` calls it after every batch, so it must be cheap:
    remember the meter, send its totals now and then, never block on I/O."""

    def note_stalls(self, reader_id: str, meter: stalls.StallMeter) -> None: ...
