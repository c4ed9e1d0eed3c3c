"""What the node cache counts as memory-tier hits and misses: a reader's lookups only.

`shardcache:cache_hit_ratio:rate5m` (docs/monitoring.md) is made of these counters. A
cold shard's acquire used to count two misses (its lookup, and the insert's own
`get_or_insert`), and every readahead, fill and warm-up insert one more with no reader
asking, so an epoch with one warm shard in five read 38% where 20% of the shards were
served warm.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardcache import errors
from shardcache.node import caches, regular_files
from tests.support import nodes

pytestmark = pytest.mark.integration

SHARDS = [120, 80, 100, 60, 90]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[caches.CacheNode]:
    yield from nodes.quiet_node(tmp_path, SHARDS)


def memory_counts(node: caches.CacheNode) -> tuple[int, int]:
    stats = node.stats()
    return stats.hits["memory"], stats.misses["memory"]


@pytest.mark.parametrize("timeout", [30.0, None], ids=["sidecar", "embedded"])
def test_a_cold_acquire_counts_one_memory_miss_and_its_hand_over_one_hit(
    node: caches.CacheNode, timeout: float | None
) -> None:
    node.acquire(0, timeout=timeout).release()
    assert memory_counts(node) == (1, 1), "(hits, misses) after one cold acquire"
    # Warm now: a hit and nothing else.
    node.acquire(0, timeout=timeout).release()
    assert memory_counts(node) == (2, 1), "(hits, misses) after a warm acquire"


def test_readahead_and_warm_up_inserts_are_no_lookups_and_count_nothing_in_memory(
    node: caches.CacheNode,
) -> None:
    assert node._prefetch(1, "readahead") == "inserted"
    assert node._prefetch(2, "fill") == "inserted"
    node.warm([3])
    assert memory_counts(node) == (0, 0), "(hits, misses) with no reader lookup"
    # The sidecar's warm-up acquires its startup shards without a reader.
    node.acquire(4, timeout=30, count=False).release()
    assert memory_counts(node) == (0, 0), "(hits, misses) after the warm-up's acquire"
    # The disk tier's lookups are the fills': each of the four fetched its bytes.
    stats = node.stats()
    assert (stats.hits["disk"], stats.misses["disk"]) == (0, 4)
    # A reader then takes a readahead's shard: a hit, never a miss.
    node.acquire(1, timeout=30).release()
    assert memory_counts(node) == (1, 0)


def test_an_epoch_with_one_warm_shard_in_five_reads_a_fifth_of_its_shards_warm(
    node: caches.CacheNode,
) -> None:
    """The recording rule's memory-tier ratio, (hits - misses) / hits, from the counters
    one reader's epoch leaves (docs/monitoring.md, "Recording rules")."""
    node.warm([0])
    for shard in range(len(SHARDS)):
        node.acquire(shard, timeout=30).release()
    hits, misses = memory_counts(node)
    assert (hits, misses) == (5, 4)
    assert (hits - misses) / hits == pytest.approx(0.2)


def test_a_failed_fetch_is_kept_as_the_last_fetch_error_with_shard_path_reason_and_time(
    node: caches.CacheNode,
) -> None:
    assert node.stats().last_fetch_error is None
    (Path(node.manifest.root.removeprefix("file://")) / node.manifest.shards[3].path).unlink()
    with pytest.raises(errors.ShardcacheError):
        node.acquire(3, timeout=30)
    stats = node.stats()
    assert stats.fetch_failures == 1
    failure = stats.last_fetch_error
    assert failure is not None
    assert (failure.shard, failure.path) == (3, "part-00003.parquet")
    assert "fetching shard 3 (part-00003.parquet)" in failure.error, failure
    assert "No such file" in failure.error, failure
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", failure.at), failure


def test_stats_name_a_tier_whose_lock_cannot_be_opened_and_still_read_the_other(
    node: caches.CacheNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A /metrics scrape reads these: a disk tier gone bad under a running sidecar (its
    directory made unwritable; here its lock refused as to a user who may not read it)
    used to fail the whole scrape with the tier lock's OSError. (A directory or a FIFO
    in the lock's place no longer does: it is replaced by a regular lock file.)"""
    node.acquire(0, timeout=30).release()
    before = node.stats()
    assert before.disk_resident_bytes > 0 and before.tier_errors == {}
    lock = os.fspath(node.disk.root / ".tier.lock")
    real = os.open

    def refusing(name: str | bytes | os.PathLike[str], *args: object, **kw: object) -> int:
        if os.fspath(name) == lock:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), lock)
        return real(name, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(regular_files.os, "open", refusing)
    stats = node.stats()
    assert list(stats.tier_errors) == ["disk"]
    assert stats.tier_errors["disk"].startswith(f"disk tier {node.disk.root}: PermissionError")
    assert stats.disk_resident_bytes == 0
    assert stats.memory_resident_bytes == before.memory_resident_bytes > 0
    monkeypatch.undo()
    assert node.stats().tier_errors == {}
