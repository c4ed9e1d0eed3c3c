"""A cache node over a local dataset written for the test, with no readahead: the
tests that count what a node does (leases, hits and misses) drive every load."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow.fs as pafs

from shardcache import manifests
from shardcache.node import caches
from tests.support import datasets


def quiet_node(tmp_path: Path, shards: Sequence[int]) -> Iterator[caches.CacheNode]:
    """For a fixture: a node over `shards` (rows each) under `tmp_path`, closed after."""
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), list(shards))
    manifest = manifests.resolve(f"file://{tmp_path / 'ds'}")
    settings = caches.NodeSettings(
        disk_dir=tmp_path / "disk", memory_dir=tmp_path / "mem", prefetch_depth=0
    )
    node = caches.CacheNode(manifest, settings)
    yield node
    node.close()
