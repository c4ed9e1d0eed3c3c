"""Sidecar metrics (observer callbacks, stats collector) and readiness gates."""

from __future__ import annotations

import pytest
from shardcache_sidecar import metrics, readiness

from shardcache.node import caches

pytestmark = pytest.mark.unit


def sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


def test_observer_events_and_node_stats_become_metrics() -> None:
    m = metrics.Metrics()
    stats: list[caches.NodeStats] = []
    m.watch(lambda: stats[0] if stats else None, lambda: bool(stats))
    before = m.render().decode()
    assert sample(before, "shardcache_ready") == 0
    assert "shardcache_cache_resident_bytes" not in before  # no node yet
    m.hit("memory")
    m.miss("disk")
    m.evicted("memory", 300)
    m.corrupted("disk", "k")
    m.fetched(1000, 0.2)
    m.fetch_failed(3, OSError("boom"))
    stats.append(
        caches.NodeStats(
            disk_resident_bytes=10,
            disk_limit_bytes=100,
            memory_resident_bytes=5,
            memory_limit_bytes=50,
            sample_windows_bytes=40,
            readers=2,
            volume_cycles=3,
        )
    )
    text = m.render().decode()
    assert sample(text, 'shardcache_cache_hits_total{tier="memory"}') == 1
    assert sample(text, 'shardcache_cache_hits_total{tier="disk"}') == 0
    assert sample(text, 'shardcache_cache_misses_total{tier="disk"}') == 1
    assert sample(text, 'shardcache_cache_evicted_bytes_total{tier="memory"}') == 300
    assert sample(text, 'shardcache_cache_corrupted_entries_total{tier="disk"}') == 1
    assert sample(text, "shardcache_source_fetched_bytes_total") == 1000
    assert sample(text, 'shardcache_source_errors_total{op="fetch"}') == 1
    assert sample(text, 'shardcache_source_errors_total{op="manifest"}') == 0
    assert sample(text, 'shardcache_source_fetch_duration_seconds_bucket{le="0.25"}') == 1
    assert sample(text, 'shardcache_cache_resident_bytes{tier="disk"}') == 10
    assert sample(text, 'shardcache_cache_limit_bytes{tier="memory"}') == 50
    assert sample(text, "shardcache_sample_windows_bytes") == 40
    assert sample(text, "shardcache_readers") == 2
    assert sample(text, "shardcache_memory_volume_cycles_total") == 3
    assert sample(text, "shardcache_ready") == 1


def test_a_failed_manifest_resolution_counts_as_a_source_error_beside_the_fetches() -> None:
    """A sidecar that cannot resolve its manifest at start-up fetches nothing: its
    failures must count, or the source-error rule and its alert stay at zero."""
    m = metrics.Metrics()
    before = m.render().decode()
    # Both present from the first scrape, so rate() has a zero to start from.
    assert sample(before, 'shardcache_source_errors_total{op="fetch"}') == 0
    assert sample(before, 'shardcache_source_errors_total{op="manifest"}') == 0
    m.manifest_failed()
    m.manifest_failed()
    text = m.render().decode()
    assert sample(text, 'shardcache_source_errors_total{op="manifest"}') == 2
    assert sample(text, 'shardcache_source_errors_total{op="fetch"}') == 0


def test_a_readahead_failure_counts_apart_from_the_source_errors() -> None:
    """The readahead's failed fetch of a shard no reader waited on is not a source error
    of the data path: one missing shard counted three times there (docs/monitoring.md)."""
    m = metrics.Metrics()
    assert sample(m.render().decode(), "shardcache_readahead_failures_total") == 0
    m.readahead_failed(3, OSError("boom"))
    m.readahead_failed(3, OSError("boom"))
    text = m.render().decode()
    assert sample(text, "shardcache_readahead_failures_total") == 2
    assert sample(text, 'shardcache_source_errors_total{op="fetch"}') == 0
    m.fetch_failed(3, OSError("boom"))
    text = m.render().decode()
    assert sample(text, 'shardcache_source_errors_total{op="fetch"}') == 1
    assert sample(text, "shardcache_readahead_failures_total") == 2


def test_two_sidecars_in_one_process_have_separate_registries() -> None:
    a, b = metrics.Metrics(), metrics.Metrics()
    a.fetched(10, 0.1)
    assert sample(b.render().decode(), "shardcache_source_fetched_bytes_total") == 0


def test_ready_only_when_every_gate_is_open_and_reasons_are_reported() -> None:
    r = readiness.Readiness()
    r.require("manifest", "resolving")
    r.require("checkpoint-restore", "restoring step 7")
    r.open("manifest", "sha256:x")
    assert not r.is_ready()
    r.waiting("checkpoint-restore", "retrying: 503")
    r.waiting("manifest", "ignored once open")
    report = r.report()
    assert report["ready"] is False
    assert report["checks"] == [
        {"name": "manifest", "ok": True, "reason": "sha256:x"},
        {"name": "checkpoint-restore", "ok": False, "reason": "retrying: 503"},
    ]
    r.open("checkpoint-restore")
    assert r.is_ready() and r.report()["ready"] is True


def test_a_volume_cycle_is_counted_with_the_error_its_reader_got() -> None:
    """A rank that failed on the memory volume's cycle exits; the count and the last
    error stay in /v1/status's stats, and the metric behind its alert moves."""
    counting = caches._Counting(None)
    assert counting.snapshot().volume_cycles == 0
    assert counting.snapshot().last_volume_cycle is None
    counting.volume_cycle("first")
    counting.volume_cycle("the memory volume /run/m (5 bytes) cannot hold ...")
    stats = counting.snapshot()
    assert stats.volume_cycles == 2
    assert stats.last_volume_cycle is not None
    assert stats.last_volume_cycle.error.startswith("the memory volume /run/m")
    assert stats.last_volume_cycle.at.endswith("Z")
