"""An acquire that makes a shard resident holds it from its insert on: another reader's
eviction between the insert and the hand-over cannot take it (issue 14: K readers on a
memory tier smaller than the dataset; a tight tier used to fail with "evicted from the
memory tier again and again before it could be leased")."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pytest

from shardcache import manifests
from shardcache.node import caches, tiers
from tests.support import datasets

pytestmark = pytest.mark.integration

SHARDS = [300, 200, 100]


def evicting_before_every_lookup(node: caches.CacheNode) -> list[str]:
    """The memory tier as a reader beside a busy one meets it: before every lookup,
    another reader's insert evicts whatever nobody leases. Returns the keys evicted."""
    memory = node.memory
    real = memory.lookup
    evicted: list[str] = []

    def lookup(key: str, *, count: bool = True) -> tiers.Entry | None:
        resident = memory.keys()  # a Tier's committed keys, not a dict's
        for other in resident:
            if memory.evict(other):
                evicted.append(other)
        return real(key, count=count)

    memory.lookup = lookup  # type: ignore[method-assign]
    return evicted


def test_a_shard_an_acquire_inserted_is_handed_over_though_others_evict_at_every_turn(
    tmp_path: Path,
) -> None:
    expected = datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    manifest = manifests.resolve(f"file://{tmp_path / 'ds'}")
    settings = caches.NodeSettings(
        disk_dir=tmp_path / "disk", memory_dir=tmp_path / "mem", prefetch_depth=0
    )
    node = caches.CacheNode(manifest, settings)
    try:
        evicted = evicting_before_every_lookup(node)
        batches = []
        for shard in range(len(SHARDS)):
            with node.acquire(shard, timeout=30) as entry:
                batches.append(ipc.open_file(pa.memory_map(str(entry.path))).get_batch(0))
                # Leased: the eviction before the next lookup leaves it where it is.
                assert not node.memory.evict(entry.key)
        stats = node.stats()
    finally:
        node.close()

    assert pa.Table.from_batches(batches).equals(expected)
    # Each shard was evicted once its reader let it go, before the next acquire's lookup.
    assert evicted == [manifest.decoded_key(s) for s in range(len(SHARDS) - 1)]
    # One memory hit per shard handed to a reader, as when the acquire looked it up again.
    assert stats.hits["memory"] == len(SHARDS)
