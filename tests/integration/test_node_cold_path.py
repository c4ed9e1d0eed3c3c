"""The node cache's cold path hashes each shard's bytes once, as they arrive, and never
its decoded form; a disk-tier hit is still hashed against the manifest (issue 14's cold
path, issue 13's integrity rule; docs/cache-format.md, format version 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pytest

from shardcache import manifests
from shardcache.node import caches, names, tiers
from shardcache.node.tiers import _entries
from tests.support import datasets

pytestmark = pytest.mark.integration

SHARDS = [300, 200, 100]


def read_back_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file hashed by reading it back (the tier's insert, a disk-tier hit check)."""
    hashed: list[Path] = []
    real = _entries.sha256_file

    def counting(path: Path, *, fsync: bool = False) -> str:
        hashed.append(Path(path))
        return real(path, fsync=fsync)

    monkeypatch.setattr(_entries, "sha256_file", counting)
    monkeypatch.setattr(tiers, "sha256_file", counting)
    return hashed


def acquire_all(manifest: manifests.Manifest, disk: Path, memory: Path) -> pa.Table:
    settings = caches.NodeSettings(disk_dir=disk, memory_dir=memory, fetch_concurrency=2)
    node = caches.CacheNode(manifest, settings)
    batches = []
    try:
        for shard in range(len(manifest.shards)):
            with node.acquire(shard, timeout=60) as entry:
                batches.append(ipc.open_file(pa.memory_map(str(entry.path))).get_batch(0))
    finally:
        node.close()
    return pa.Table.from_batches(batches)


def metas(directory: Path) -> dict[str, dict[str, object]]:
    return {
        p.name[: -len(names.META_SUFFIX)]: json.loads(p.read_text())
        for p in directory.glob("*" + names.META_SUFFIX)
        if not p.name.startswith(".")
    }


def test_a_cold_shard_is_hashed_as_it_arrives_and_its_decoded_form_never(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    manifest = manifests.resolve(f"file://{tmp_path / 'ds'}")
    hashed = read_back_hashes(monkeypatch)

    served = acquire_all(manifest, tmp_path / "disk", tmp_path / "mem")

    assert served.equals(expected)
    assert hashed == []  # the fetch hashed the source on the way; nothing was read back
    disk = metas(tmp_path / "disk")
    assert sorted(m["sha256"] for m in disk.values()) == sorted(s.sha256 for s in manifest.shards)
    assert {m["format_version"] for m in disk.values()} == {1}  # older sidecars read them
    memory = metas(tmp_path / "mem")
    assert len(memory) == len(SHARDS)
    assert all(m["sha256"] is None and m["format_version"] == 2 for m in memory.values())


def test_a_disk_tier_hit_is_still_hashed_against_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    manifest = manifests.resolve(f"file://{tmp_path / 'ds'}")
    acquire_all(manifest, tmp_path / "disk", tmp_path / "mem-1")
    hashed = read_back_hashes(monkeypatch)

    # A second pod on the node: the same disk tier, its own memory tier.
    served = acquire_all(manifest, tmp_path / "disk", tmp_path / "mem-2")

    assert served.equals(expected)
    disk_entries = {manifest.source_key(i) for i in range(len(SHARDS))}
    assert sorted(p.name for p in hashed) == sorted(disk_entries)  # each hit once, no more
