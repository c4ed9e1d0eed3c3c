"""Prometheus metrics of the sidecar.

Counters and the fetch-latency histogram are fed by the cache's observer callbacks as
events happen (`Metrics` is a `NodeObserver`); gauges (resident bytes, limits, readers)
are read from `CacheNode.stats()` at scrape time by a custom collector, so they are
never stale. One registry per sidecar (not the global default), so tests can run
several in one process.

Names follow Prometheus conventions: `shardcache_` prefix, base units in the name,
`_total` on counters. The list is in docs/wire-format.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client import core as prom_core
from prometheus_client import registry as prom_registry

from shardcache.contract import protocol
from shardcache.node import backings, caches

log = logging.getLogger(__name__)

TIERS = ("disk", "memory")
# Fetch latency buckets in seconds: small shards from a local store take milliseconds,
# GiB shards from a remote store a minute or more.
FETCH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


#: What the stall collector reads at scrape time: (reader id, rank, its last totals).
ReaderStalls = tuple[str, int, protocol.Stalls]


class _StallCollector(prom_registry.Collector):
    """Each registered reader's recent stall fraction, read from the registry at scrape
    time: a reader that goes away leaves the scrape with it, no stale series."""

    def __init__(self, readers: Callable[[], list[ReaderStalls]]) -> None:
        self._readers = readers

    def describe(self) -> list[prom_core.Metric]:
        return []

    def collect(self) -> Iterator[prom_core.Metric]:
        fraction = prom_core.GaugeMetricFamily(
            "shardcache_reader_stall_fraction",
            "Share of a reader's training-loop time spent waiting for data, over about its "
            "last 20 batches (0: data always ready, 1: the loop only waits).",
            labels=["reader", "rank"],
        )
        for reader_id, rank, stalls in self._readers():
            fraction.add_metric([reader_id, str(rank)], stalls.recent_fraction)
        yield fraction


#: What the depth collector reads at scrape time: (reader id, rank, its prefetch depth).
ReaderDepth = tuple[str, int, int]

#: What a source error is counted under (`op`): a shard fetch, or the manifest's
#: resolution at start-up (while it fails, /readyz says why and no shard is fetched).
SOURCE_OPS = ("fetch", "manifest")

#: Every (direction, reason) a depth change is counted under (`prefetch_depths.Reason`).
DEPTH_CHANGES = (("up", "stalled"), ("down", "recovered"), ("down", "memory"))


class _DepthCollector(prom_registry.Collector):
    """Each registered reader's prefetch depth, read at scrape time: a reader that goes
    away leaves the scrape with it."""

    def __init__(self, readers: Callable[[], list[ReaderDepth]]) -> None:
        self._readers = readers

    def describe(self) -> list[prom_core.Metric]:
        return []

    def collect(self) -> Iterator[prom_core.Metric]:
        depth = prom_core.GaugeMetricFamily(
            "shardcache_prefetch_depth",
            "Shards the sidecar reads ahead of each reader now: the configured depth, or "
            "what the prefetch tuner set it to (prefetch.adaptive).",
            labels=["reader", "rank"],
        )
        for reader_id, rank, shards in self._readers():
            depth.add_metric([reader_id, str(rank)], float(shards))
        yield depth


#: What the stats collector reads of the tier check at scrape time: what keeps the
#: sidecar from using each tier directory, by tier (empty: none), None before it ran.
TierProblems = Callable[[], Mapping[str, str] | None]


class _StatsCollector(prom_registry.Collector):
    def __init__(
        self,
        stats: Callable[[], caches.NodeStats | None],
        ready: Callable[[], bool],
        tier_problems: TierProblems,
    ) -> None:
        self._stats = stats
        self._ready = ready
        self._tier_problems = tier_problems

    def describe(self) -> list[prom_core.Metric]:
        # Not described up front: collect() may only run once the node exists.
        return []

    def collect(self) -> Iterator[prom_core.Metric]:
        ready = prom_core.GaugeMetricFamily(
            "shardcache_ready", "1 when /readyz answers 200 (data warm, digest matches)."
        )
        ready.add_metric([], 1.0 if self._ready() else 0.0)
        yield ready
        stats = self._stats()
        problems = self._tier_problems()
        if problems is not None:
            unread = {} if stats is None else stats.tier_errors
            usable = prom_core.GaugeMetricFamily(
                "shardcache_cache_tier_usable",
                "1 while the sidecar can use the tier's directory: its start-up check "
                "(create it, lock it, create a file) passed and the scrape read its size; "
                "0 when not: /readyz's tiers gate and the log say why.",
                labels=["tier"],
            )
            for tier in TIERS:
                usable.add_metric([tier], 0.0 if tier in problems or tier in unread else 1.0)
            yield usable
        if stats is None:
            return
        resident = prom_core.GaugeMetricFamily(
            "shardcache_cache_resident_bytes",
            "Bytes held by each cache tier on this node.",
            labels=["tier"],
        )
        # A tier whose size could not be read has no sample rather than a false 0.
        if "disk" not in stats.tier_errors:
            resident.add_metric(["disk"], stats.disk_resident_bytes)
        if "memory" not in stats.tier_errors:
            resident.add_metric(["memory"], stats.memory_resident_bytes)
        yield resident
        limit = prom_core.GaugeMetricFamily(
            "shardcache_cache_limit_bytes",
            "Configured byte limit of each cache tier.",
            labels=["tier"],
        )
        limit.add_metric(["disk"], stats.disk_limit_bytes)
        limit.add_metric(["memory"], stats.memory_limit_bytes)
        yield limit
        windows = prom_core.GaugeMetricFamily(
            "shardcache_sample_windows_bytes",
            "Bytes the sample-mode readers' current and next windows take in the memory "
            "tier at once, each shard once (0 without such readers); above the memory "
            "tier's limit, their acquires fail (docs/reading-plan.md).",
        )
        windows.add_metric([], stats.sample_windows_bytes)
        yield windows
        readers = prom_core.GaugeMetricFamily(
            "shardcache_readers", "Readers registered with this sidecar (incl. the startup plan)."
        )
        readers.add_metric([], stats.readers)
        yield readers
        cycles = prom_core.CounterMetricFamily(
            "shardcache_memory_volume_cycles",
            "Acquires failed because the readers themselves held the room the memory "
            "volume lacked (shards the tier evicted that they still map): the volume is "
            "too small for this many readers, or they keep batches while they ask for "
            "the next (/v1/status stats.last_volume_cycle says what was missing).",
        )
        cycles.add_metric([], stats.volume_cycles)
        yield cycles


class MixtureCollector(prom_registry.Collector):
    """Per-source metrics of a multi-source mount, labelled `source`.

    Each source has a cache of its own (`server.running.source_settings`); the first
    source's registry, the one scraped on the pod's port, carries this collector, which
    reads every source's `NodeStats` at scrape time. The names differ from the
    single-cache ones (`shardcache_mixture_…`), so the sidecar's own series stay as
    they are: those count the first source.
    """

    def __init__(self, stats: Callable[[], Mapping[str, caches.NodeStats | None]]) -> None:
        self._stats = stats

    def describe(self) -> list[prom_core.Metric]:
        return []

    def collect(self) -> Iterator[prom_core.Metric]:
        readers = prom_core.GaugeMetricFamily(
            "shardcache_mixture_source_readers",
            "Readers registered with each source's cache (the startup plan included).",
            labels=["source"],
        )
        resident = prom_core.GaugeMetricFamily(
            "shardcache_mixture_source_resident_bytes",
            "Bytes held by each source's cache tier.",
            labels=["source", "tier"],
        )
        fetched = prom_core.CounterMetricFamily(
            "shardcache_mixture_source_fetched_bytes",
            "Bytes each source read from the object store.",
            labels=["source"],
        )
        hits = prom_core.CounterMetricFamily(
            "shardcache_mixture_source_cache_hits",
            "Lookups of each source's shards that found the shard.",
            labels=["source", "tier"],
        )
        misses = prom_core.CounterMetricFamily(
            "shardcache_mixture_source_cache_misses",
            "Lookups of each source's shards that did not.",
            labels=["source", "tier"],
        )
        for name, stats in self._stats().items():
            if stats is None:
                continue
            readers.add_metric([name], float(stats.readers))
            if "disk" not in stats.tier_errors:
                resident.add_metric([name, "disk"], float(stats.disk_resident_bytes))
            if "memory" not in stats.tier_errors:
                resident.add_metric([name, "memory"], float(stats.memory_resident_bytes))
            fetched.add_metric([name], float(stats.fetched_bytes))
            for tier in TIERS:
                hits.add_metric([name, tier], float(stats.hits.get(tier, 0)))
                misses.add_metric([name, tier], float(stats.misses.get(tier, 0)))
        yield from (readers, resident, fetched, hits, misses)


class Metrics:
    """The sidecar's registry; also the cache's observer (thread-safe, called from
    fetch threads)."""

    def __init__(self) -> None:
        self.registry = prom_registry.CollectorRegistry(auto_describe=True)
        r = self.registry
        self.fetched_bytes = prometheus_client.Counter(
            "shardcache_source_fetched_bytes",
            "Bytes read from the object store.",
            registry=r,
        )
        self.fetch_seconds = prometheus_client.Histogram(
            "shardcache_source_fetch_duration_seconds",
            "Time to fetch one shard from the object store, retries included.",
            buckets=FETCH_BUCKETS,
            registry=r,
        )
        self.source_errors = prometheus_client.Counter(
            "shardcache_source_errors",
            "Source reads that failed after retries, by op: a shard fetch (fetch), or "
            "resolving the manifest at start-up (manifest; /readyz says why).",
            ["op"],
            registry=r,
        )
        # Present from the first scrape, so rate() has a zero to start from.
        for op in SOURCE_OPS:
            self.source_errors.labels(op)
        # Apart from source_errors: the readahead and the fill try a shard before its
        # reader asks, again after a failure, and the reader's acquire fetches it once
        # more; counted there, one missing shard read as three failures and more.
        self.readahead_failures = prometheus_client.Counter(
            "shardcache_readahead_failures",
            "Shard fetches of the readahead or the fill that failed after retries with "
            "no reader waiting on them (a reader's own failed fetch counts in "
            'shardcache_source_errors_total{op="fetch"}).',
            registry=r,
        )
        self.manifests = prometheus_client.Counter(
            "shardcache_manifest_loads",
            "Manifests loaded at start-up, by where from: the object store (source), "
            "the pinned copy in the node disk tier (node), or handed over by the operator "
            "(operator).",
            ["origin"],
            registry=r,
        )
        self.hits = prometheus_client.Counter(
            "shardcache_cache_hits",
            "Lookups that found the shard in the tier.",
            ["tier"],
            registry=r,
        )
        self.misses = prometheus_client.Counter(
            "shardcache_cache_misses",
            "Lookups that did not find the shard in the tier.",
            ["tier"],
            registry=r,
        )
        self.evictions = prometheus_client.Counter(
            "shardcache_cache_evictions", "Entries evicted from the tier.", ["tier"], registry=r
        )
        self.evicted_bytes = prometheus_client.Counter(
            "shardcache_cache_evicted_bytes", "Bytes evicted from the tier.", ["tier"], registry=r
        )
        self.corrupted_entries = prometheus_client.Counter(
            "shardcache_cache_corrupted_entries",
            "Entries found corrupted or truncated, removed and fetched again.",
            ["tier"],
            registry=r,
        )
        self.requests = prometheus_client.Counter(
            "shardcache_control_requests",
            "Control API requests by route and HTTP status.",
            ["route", "status"],
            registry=r,
        )
        # Seconds by rank, not by reader: ranks are few and stable across a trainer's
        # restarts, reader ids are new every time a dataset is opened.
        self.data_wait = prometheus_client.Counter(
            "shardcache_data_wait_seconds",
            "Seconds the training loop waited inside the iterator for a batch (reported "
            "by the client library each second).",
            ["rank"],
            registry=r,
        )
        self.data_step = prometheus_client.Counter(
            "shardcache_data_step_seconds",
            "Seconds the training loop spent between batches (its steps).",
            ["rank"],
            registry=r,
        )
        self.readers_dropped = prometheus_client.Counter(
            "shardcache_readers_dropped_dead",
            "Readers the sidecar dropped because the process that opened them was gone "
            "(a rank killed mid-epoch): their reader lock was free.",
            registry=r,
        )
        self.memory_backing = prometheus_client.Gauge(
            "shardcache_memory_tier_backing_info",
            "1 for what backs the memory tier: filesystem and, for tmpfs, page size "
            "(4KiB, huge); warm reads of 4 KiB-page tmpfs pay a TLB miss per page.",
            ["filesystem", "pages"],
            registry=r,
        )
        self.depth_changes = prometheus_client.Counter(
            "shardcache_prefetch_depth_changes",
            "Changes of a reader's prefetch depth by the tuner, by direction (up, down) "
            "and reason (stalled, recovered, memory).",
            ["direction", "reason"],
            registry=r,
        )
        for direction, reason in DEPTH_CHANGES:
            self.depth_changes.labels(direction, reason)
        # The labelled child of each (route, status) seen: looking it up by labels on
        # every control request was a visible share of the sidecar's CPU per request.
        self._requests_by: dict[tuple[str, str], Any] = {}
        for tier in TIERS:
            # Present from the first scrape, so rate() has a zero to start from.
            for counter in (
                self.hits,
                self.misses,
                self.evictions,
                self.evicted_bytes,
                self.corrupted_entries,
            ):
                counter.labels(tier)
        # Likewise a hit's child: a `notes` batch counts one per shard a reader pinned.
        self._hits_by = {tier: self.hits.labels(tier) for tier in TIERS}

    def watch(
        self,
        stats: Callable[[], caches.NodeStats | None],
        ready: Callable[[], bool],
        tier_problems: TierProblems = lambda: None,
    ) -> None:
        """Export gauges read from `stats()` (None while there is no node yet), and
        whether each tier is usable from `tier_problems()` and the stats."""
        self.registry.register(_StatsCollector(stats, ready, tier_problems))

    def watch_readers(self, readers: Callable[[], list[ReaderStalls]]) -> None:
        """Export each reader's stall fraction, read from `readers()` at scrape time."""
        self.registry.register(_StallCollector(readers))

    def watch_depths(self, readers: Callable[[], list[ReaderDepth]]) -> None:
        """Export each reader's prefetch depth, read from `readers()` at scrape time."""
        self.registry.register(_DepthCollector(readers))

    def reader_dropped_dead(self) -> None:
        """Count one reader dropped because its process was gone."""
        self.readers_dropped.inc()

    def depth_changed(self, direction: str, reason: str) -> None:
        """Count one change of a reader's prefetch depth (`prefetch_tuner.Changes`)."""
        self.depth_changes.labels(direction, reason).inc()

    def stalled(self, rank: int, wait_seconds: float, step_seconds: float) -> None:
        """Add what a reader's stall totals grew by since its last report."""
        self.data_wait.labels(str(rank)).inc(wait_seconds)
        self.data_step.labels(str(rank)).inc(step_seconds)

    def backed_by(self, found: backings.Backing | None) -> None:
        """Record what backs the memory tier (once, at start-up)."""
        if found is None:
            self.memory_backing.labels("unknown", "unknown").set(1)
        elif found.fstype == "tmpfs":
            self.memory_backing.labels("tmpfs", "4KiB" if found.small_pages else "huge").set(1)
        else:
            self.memory_backing.labels(found.fstype, "page-cache").set(1)

    def render(self) -> bytes:
        return bytes(prometheus_client.generate_latest(self.registry))

    # --- NodeObserver -------------------------------------------------------------
    def request(self, route: str, status: int) -> None:
        """Count one control request answered with `status` on `route`."""
        key = (route, str(status))
        child = self._requests_by.get(key)
        if child is None:
            child = self._requests_by[key] = self.requests.labels(*key)
        child.inc()

    def hit(self, tier: str) -> None:
        self.reused(tier, 1)

    def reused(self, tier: str, count: int) -> None:
        child = self._hits_by.get(tier)
        (self.hits.labels(tier) if child is None else child).inc(count)

    def miss(self, tier: str) -> None:
        self.misses.labels(tier).inc()

    def evicted(self, tier: str, nbytes: int) -> None:
        self.evictions.labels(tier).inc()
        self.evicted_bytes.labels(tier).inc(nbytes)

    def corrupted(self, tier: str, key: str) -> None:
        self.corrupted_entries.labels(tier).inc()

    def fetched(self, nbytes: int, seconds: float) -> None:
        self.fetched_bytes.inc(nbytes)
        self.fetch_seconds.observe(seconds)

    def fetch_failed(self, shard: int, error: BaseException) -> None:
        self.source_errors.labels("fetch").inc()

    def readahead_failed(self, shard: int, error: BaseException) -> None:
        self.readahead_failures.inc()

    def manifest_failed(self) -> None:
        """Count one failed try to resolve the manifest at start-up (`op="manifest"`)."""
        self.source_errors.labels("manifest").inc()

    def manifest_loaded(self, origin: str) -> None:
        """`origin`: "source" (resolved from the object store), "node" (the pinned
        copy in the node disk tier, `shardcache.node.pinned_manifests`) or "operator"
        (handed over in ConfigMaps, `shardcache.node.handed_manifests`)."""
        self.manifests.labels(origin=origin).inc()
