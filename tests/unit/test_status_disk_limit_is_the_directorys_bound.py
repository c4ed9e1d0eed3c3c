"""The status's disk limit is what bounds the shared disk tier's directory.

Sidecars of one namespace share its node disk tier, and every insert counts against
the largest live limit declared under `.limits/` (`tiers._limits`). `/v1/status`'s
`stats.disk_limit_bytes` (and the `shardcache_cache_limit_bytes{tier="disk"}` gauge)
still showed the sidecar's own `cache.disk`: beside the directory's resident bytes, a
small mount's status read "1.2 GB used of a 1 GB limit". Now `disk_limit_bytes` is the
directory's bound and `disk_own_limit_bytes` the sidecar's own limit.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest

from shardcache import manifests
from shardcache.node import caches, tiers
from tests.support import datasets

pytestmark = pytest.mark.unit


def fill(path: Path) -> None:
    path.write_bytes(b"x" * 100)


def test_a_tiers_bound_is_the_largest_live_limit_declared_in_its_directory(
    tmp_path: Path,
) -> None:
    small = tiers.Tier(tmp_path, limit_bytes=300, name="disk", wait_timeout=0.5)
    assert small.bound_bytes() == 300  # nobody else declared
    big = tiers.Tier(tmp_path, limit_bytes=1000, name="disk", wait_timeout=0.5)
    big.insert("b", 100, fill).release()  # declares its limit at its first insert
    assert small.bound_bytes() == 1000
    assert big.bound_bytes() == 1000
    sole = tiers.Tier(tmp_path / "sole", limit_bytes=50, name="memory", sole_writer=True)
    assert sole.bound_bytes() == 50


def test_the_status_reports_the_directorys_bound_and_the_own_limit(tmp_path: Path) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [10, 10])
    manifest = manifests.resolve(f"file://{tmp_path / 'ds'}")
    shared = tmp_path / "disk"
    settings = caches.NodeSettings(
        disk_dir=shared, memory_dir=tmp_path / "mem", prefetch_depth=0, disk_limit=1 << 20
    )
    node = caches.CacheNode(manifest, settings)
    try:
        # Another mount's sidecar on the node, with a larger cache.disk, has inserted.
        other = tiers.Tier(shared, limit_bytes=5 << 20, name="disk", wait_timeout=0.5)
        other.insert("theirs", 100, fill).release()
        stats = node.stats()
    finally:
        node.close()
    assert stats.disk_limit_bytes == 5 << 20
    assert stats.disk_own_limit_bytes == 1 << 20
